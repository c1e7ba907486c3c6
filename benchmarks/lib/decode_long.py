"""Batch-1 decode attention at long context (needs a CUDA GPU): the Triton decode kernel's split
count and tile config swept over one sequence of 128k to 1M keys, each timing against the measured
copy bandwidth, so the split rule for few long sequences is set by measurement.

One layer's paged cache (blocks scattered by a permutation), one query, replayed from a CUDA graph.
GB/s counts the K and V bytes a step reads; ``of_copy`` is that over the copy bandwidth (read +
written bytes per second of a device-to-device copy), the engine's floor model.
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

SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head_dim


@dataclass
class Cell:
    shape: str
    context: int
    kv_dtype: str
    splits: int
    block_n: int
    num_warps: int
    num_stages: int
    us: float
    gb_s: float
    of_copy: float
    chosen: bool  # the split count and config the engine picks today


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/decode_long"))
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--contexts", type=int, nargs="+", default=[131072, 1 << 20])
    p.add_argument("--kv-dtypes", nargs="+", choices=("bfloat16", "fp8"), default=["bfloat16", "fp8"])
    p.add_argument("--splits", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    p.add_argument("--block-ns", type=int, nargs="+", default=[64, 128, 256])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
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


def _time_case(args: argparse.Namespace, shape: str, context: int, kv_dtype: str, copy_bw: float) -> list[Cell]:
    """Every (splits, tile config) of the grid on one sequence of ``context`` keys."""
    from vllm_actors.kernels.triton_decode import choose_decode_splits, decode_config, paged_attention_decode
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
    default = decode_config(head_dim)
    cells: list[Cell] = []
    spin_up()
    for splits, block_n, warps, stages in itertools.product(args.splits, args.block_ns, args.warps, args.stages):
        cfg = TileConfig(block_m=default.block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        step = functools.partial(paged_attention_decode, num_splits=splits, config=cfg, **fixed)
        try:
            ms = do_bench_graph(step, args)
        except Exception as exc:  # a config the GPU cannot run (shared memory): recorded as skipped
            print(f"skip {shape} {context} {kv_dtype} s{splits} n{block_n} w{warps} st{stages}: {exc!r:.80}")
            continue
        rate = kv_bytes / (ms / 1e3)
        cells.append(Cell(shape, context, kv_dtype, splits, block_n, warps, stages, ms * 1e3, rate / 1e9,
                          rate / copy_bw, splits == chosen_splits and cfg == default))
    if cells:
        best = max(cells, key=lambda c: c.of_copy)
        now = [c.of_copy for c in cells if c.chosen]
        print(f"{shape} {context} {kv_dtype}: best {best.of_copy:.3f} of copy (s{best.splits} n{best.block_n} "
              f"w{best.num_warps} st{best.num_stages}, {best.us:.1f} us); engine's choice "
              f"{now[0] if now else float('nan'):.3f} (s{chosen_splits})", flush=True)
    return cells


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
