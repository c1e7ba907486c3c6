"""Batch-1 decode attention at long context (needs a CUDA GPU): the Triton decode kernel's split
count and tile config swept over one sequence of 128k to 1M keys, each timing against the measured
copy bandwidth, so the split rule for few long sequences is set by measurement.

One layer's paged cache (blocks scattered by a permutation), one query, replayed from a CUDA graph.
GB/s counts the K and V bytes a step reads; ``of_copy`` is that over the copy bandwidth (read +
written bytes per second of a device-to-device copy), the engine's floor model. An fp8 cache's cases
also sweep how its tiles meet the query (``--fp8-tiles``: the kernel's ``FP8_TILES``, "query" being
the old path), and the summary sets each variant's best and the engine's choice against the bf16
cache's at the same shape and context.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.floor import measure_copy_bandwidth
from benchmarks.lib.kernels_timing import do_bench_graph, spin_up
from vllm_actors.kernels.triton_decode import DECODE_FP8_TILES, FP8_TILES

SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head_dim


@dataclass
class Cell:
    shape: str
    context: int
    kv_dtype: str
    fp8_tiles: str  # "-" for a bf16 cache
    splits: int
    block_n: int
    num_warps: int
    num_stages: int
    us: float
    gb_s: float
    of_copy: float
    engine_config: bool  # the split count and tile config the engine picks today
    chosen: bool  # and the engine's fp8 variant
    max_registers: int = 0  # the register cap asked for (0: none)
    registers: int = 0  # of the compiled decode kernel, a thread (0: not known)
    spills: int = 0
    shared_bytes: int = 0
    programs_per_sm: int = 0  # resident at once, by registers, shared memory and warps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/decode_long"))
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 1 << 20])
    p.add_argument("--kv-dtypes", nargs="+", choices=("bfloat16", "fp8"), default=["bfloat16", "fp8"])
    p.add_argument("--fp8-tiles", nargs="+", choices=FP8_TILES, default=list(FP8_TILES),
                   help="the fp8 cache's tile variants to sweep (the kernel's fp8_tiles)")
    p.add_argument("--splits", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--block-ns", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--max-registers", type=int, nargs="+", default=[0],
                   help="caps on the decode kernel's registers a thread to sweep (0: ptxas's own count)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    return p.parse_args(argv)


def _cache(context: int, block_size: int, kv_heads: int, head_dim: int, kv_dtype: str, seed: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """K and V caches holding one sequence's ``context`` keys in scattered blocks, and its table."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = math.ceil(context / block_size)
    shape = (blocks + 8, block_size, kv_heads, head_dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    scale = None
    if kv_dtype == "fp8":
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scale = torch.ones(1, device="cuda", dtype=torch.float32)
    table = torch.randperm(blocks + 8, device="cuda", generator=gen)[:blocks].to(torch.int32)[None, :]
    return k, v, table, scale


@dataclass(frozen=True)
class KernelStats:
    registers: int = 0
    spills: int = 0
    shared_bytes: int = 0
    programs_per_sm: int = 0


def _compiled(jit_fn: Any) -> list[Any]:
    """The kernels Triton compiled of ``jit_fn`` so far, oldest first (its per-device caches)."""
    found: list[Any] = []
    for entry in getattr(jit_fn, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        found += list(cache.values()) if isinstance(cache, dict) else []
    return found


def programs_per_sm(registers: int, shared_bytes: int, warps: int, regs_per_sm: int = 65536,
                    shared_per_sm: int = 233472, warps_per_sm: int = 64) -> int:
    """Programs of ``warps`` warps a SM holds at once: registers are given out 256 a warp at a time,
    and each program's shared memory takes 1 KiB more (the runtime's reserve), Hopper's limits."""
    if registers <= 0:
        return 0
    per_warp = -(-registers * 32 // 256) * 256
    return min(regs_per_sm // (per_warp * warps), shared_per_sm // (shared_bytes + 1024), warps_per_sm // warps)


def kernel_stats(kernel: Any, warps: int, device: torch.device) -> KernelStats:
    """A compiled kernel's registers, spills and shared memory, and the programs a SM of ``device`` holds."""
    props = torch.cuda.get_device_properties(device)
    registers = int(getattr(kernel, "n_regs", 0) or 0)
    shared = int(getattr(kernel.metadata, "shared", 0) or 0)
    resident = programs_per_sm(registers, shared, warps, getattr(props, "regs_per_multiprocessor", 65536),
                               getattr(props, "shared_memory_per_multiprocessor", 233472),
                               getattr(props, "max_threads_per_multi_processor", 2048) // 32)
    return KernelStats(registers, int(getattr(kernel, "n_spills", 0) or 0), shared, resident)


def _time_case(args: argparse.Namespace, shape: str, context: int, kv_dtype: str, copy_bw: float) -> list[Cell]:
    """Every (splits, tile config) of the grid on one sequence of ``context`` keys."""
    from vllm_actors.kernels.decode_splits import _sm_count, choose_decode_splits, few_programs
    from vllm_actors.kernels.triton_decode import _decode_kernel, decode_config, paged_attention_decode
    from vllm_actors.kernels.triton_paged import TileConfig

    heads, kv_heads, head_dim = SHAPES[shape]
    k, v, table, scale = _cache(context, args.block_size, kv_heads, head_dim, kv_dtype, seed=context)
    q = torch.randn(1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    fixed: dict[str, Any] = {
             "q": q, "k_cache": k, "v_cache": v, "out": torch.empty_like(q), "k_scale": scale, "v_scale": scale,
             "query_start_loc": torch.tensor([0, 1], device="cuda", dtype=torch.int32),
             "seq_lens": torch.tensor([context], device="cuda", dtype=torch.int32),
             "block_tables": table, "max_seq_len": context, "scale": 0.125}
    kv_bytes = 2 * context * kv_heads * head_dim * k.element_size()
    chosen_splits = choose_decode_splits(1, kv_heads, context, q.device)
    default = decode_config(head_dim, few_programs(1, kv_heads, _sm_count(q.device)))
    variants = args.fp8_tiles if kv_dtype == "fp8" else ["-"]
    cells: list[Cell] = []
    spin_up()
    grid = itertools.product(variants, args.splits, args.block_ns, args.warps, args.stages, args.max_registers)
    stats: dict[tuple[Any, ...], KernelStats] = {}
    for tiles, splits, block_n, warps, stages, max_registers in grid:
        cfg = TileConfig(block_m=default.block_m, block_n=block_n, num_warps=warps, num_stages=stages,
                         max_registers=max_registers or None)
        compiled = len(_compiled(_decode_kernel))
        step = functools.partial(paged_attention_decode, num_splits=splits, config=cfg,
                                 fp8_tiles=None if tiles == "-" else tiles, **fixed)
        try:
            ms = do_bench_graph(step, args)
        except Exception as exc:  # a config the GPU cannot run (shared memory): recorded as skipped
            print(f"skip {shape} {context} {kv_dtype} {tiles} s{splits} n{block_n} w{warps} st{stages}: {exc!r:.80}")
            continue
        rate = kv_bytes / (ms / 1e3)
        engine = splits == chosen_splits and cfg == default
        key = (tiles, block_n, warps, stages, max_registers)  # the split count is no constexpr: one kernel
        kernels = _compiled(_decode_kernel)
        if key not in stats and len(kernels) > compiled:
            stats[key] = kernel_stats(kernels[-1], warps, q.device)
        seen = stats.get(key, KernelStats())
        cells.append(Cell(shape, context, kv_dtype, tiles, splits, block_n, warps, stages, ms * 1e3, rate / 1e9,
                          rate / copy_bw, engine, engine and tiles in ("-", DECODE_FP8_TILES), max_registers,
                          seen.registers, seen.spills, seen.shared_bytes, seen.programs_per_sm))
    for tiles in variants:
        of = [c for c in cells if c.fp8_tiles == tiles]
        if of:
            best = max(of, key=lambda c: c.of_copy)
            now = [c.of_copy for c in of if c.engine_config]
            print(f"{shape} {context} {kv_dtype} {tiles}: best {best.of_copy:.3f} of copy (s{best.splits} "
                  f"n{best.block_n} w{best.num_warps} st{best.num_stages} r{best.max_registers}, {best.us:.1f} us, "
                  f"{best.registers} registers, {best.programs_per_sm} programs a SM); engine's config "
                  f"{now[0] if now else float('nan'):.3f} (s{chosen_splits})", flush=True)
    return cells


def summary(cells: list[Cell]) -> list[str]:
    """Per shape and context, for each cache and fp8 variant: the engine's splits and tile config
    (microseconds and fraction of the copy bandwidth), the best cell, and the bf16 cache's engine time
    over these (the fp8 cache's speed-up; 2x is the bytes' bound). fp8/query at the engine's config is
    the engine's choice before the fp16 tiles."""
    lines = ["shape context kv/variant: engine config us (of copy) | best us (of copy) | bf16 engine / this"]
    for shape, context in sorted({(c.shape, c.context) for c in cells}):
        case = [c for c in cells if c.shape == shape and c.context == context]
        bf16 = [c.us for c in case if c.kv_dtype == "bfloat16" and c.chosen]
        for kv_dtype, tiles in sorted({(c.kv_dtype, c.fp8_tiles) for c in case}):
            of = [c for c in case if c.kv_dtype == kv_dtype and c.fp8_tiles == tiles]
            best = min(of, key=lambda c: c.us)
            engine = next((c for c in of if c.engine_config), None)
            ratios = [f"{bf16[0] / c.us:.2f}x {name}" for c, name in ((engine, "engine"), (best, "best")) if c and bf16]
            now = f"{engine.us:.1f} ({engine.of_copy:.3f})" if engine else "- (not in the grid)"
            mark = " (the engine's)" if engine and engine.chosen and kv_dtype == "fp8" else ""
            lines.append(f"{shape} {context} {kv_dtype}/{tiles}{mark}: {now} | {best.us:.1f} ({best.of_copy:.3f}) "
                         f"s{best.splits} n{best.block_n} w{best.num_warps} st{best.num_stages} | "
                         f"{', '.join(ratios) or '-'}")
    return lines


def sweep(args: argparse.Namespace) -> list[Cell]:
    copy_bw = sorted(measure_copy_bandwidth())[5]
    print(f"copy bandwidth {copy_bw / 1e12:.3f} TB/s (median)", flush=True)
    cells: list[Cell] = []
    for shape, context, kv_dtype in itertools.product(args.shapes, args.contexts, args.kv_dtypes):
        cells += _time_case(args, shape, context, kv_dtype, copy_bw)
        torch.cuda.empty_cache()
    return cells


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cells = sweep(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_long.json").write_text(json.dumps([asdict(c) for c in cells], indent=1))
    lines = summary(cells)
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
