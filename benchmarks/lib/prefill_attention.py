"""Prefill attention at long context (needs a CUDA GPU): the Triton varlen kernel against flash-attn 4's
SM90 kernel through the engine's flash-attn path (``kernels/flash_attn_prefill.py``), on the same
paged cache, one sequence whose query chunk of ``chunk`` tokens follows ``context`` cached tokens.

Shapes: Llama-3.2-1B (32 query heads, 8 KV heads, head_dim 64) and Qwen3-8B (32/8, head_dim 128),
bf16. Block sizes 16 (the engine's default: flash-attn loads pages by cp.async) and 128 (a page is
flash-attn's key tile: TMA loads). Blocks are scattered over the pool by a permutation. Optional
mixed steps put decodes beside the chunk. TFLOP/s counts causal FLOPs (4 * head_dim per visible
query-key pair and query head); times are medians of ``triton.testing.do_bench``, in ms. The
report names, per shape and block size, the shortest chunk from which flash-attn was faster at
every context (the ``auto`` rule's threshold, ``kernels/prefill_choice.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.kernels_timing import do_bench, spin_up

SHAPES = {"llama-3.2-1b": (32, 8, 64), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head_dim


@dataclass
class Case:
    shape: str
    block_size: int
    context: int  # cached tokens before the chunk
    chunk: int  # the chunk's new tokens
    decodes: int = 0  # decode rows beside it, each over decode_context tokens
    decode_context: int = 0
    kind: str = "grid"  # "grid" (chunks x contexts), "long" (a long context, one chunk) or "mixed" (decodes beside)
    ms: dict[str, float] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
    rel_diff: float | None = None  # ||flash_attn - triton|| / ||triton||

    @property
    def speedup(self) -> float | None:
        """Triton's time over flash-attn's (above 1: flash-attn faster)."""
        if "triton" in self.ms and "flash_attn" in self.ms:
            return self.ms["triton"] / self.ms["flash_attn"]
        return None


def causal_flops(num_heads: int, head_dim: int, query_lens: list[int], seq_lens: list[int]) -> float:
    """4 * head_dim per visible (query, key) pair and query head; query j of a sequence of q_len new
    tokens over seq_len sees seq_len - q_len + j + 1 keys."""
    pairs = sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(query_lens, seq_lens))
    return 4.0 * num_heads * head_dim * pairs


class Pool:
    """One shape's paged K/V pool (random bf16), its blocks in a fixed random order."""

    def __init__(self, shape: str, block_size: int, tokens: int, device: torch.device, seed: int = 0) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = SHAPES[shape]
        self.block_size = block_size
        num_blocks = math.ceil(tokens / block_size) + 1
        size = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.k_cache = torch.randn(size, device=device, dtype=torch.bfloat16, generator=gen)
        self.v_cache = torch.randn(size, device=device, dtype=torch.bfloat16, generator=gen)
        self.order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.device = device

    def metadata(self, query_lens: list[int], seq_lens: list[int]) -> Any:
        from vllm_actors.kernels.attention import build_attention_metadata

        tables, used = [], 0
        for length in seq_lens:
            count = math.ceil(length / self.block_size)
            tables.append(self.order[used : used + count])
            used += count
        if used > len(self.order):
            raise ValueError(f"the pool holds {len(self.order)} blocks, the case needs {used}")
        return build_attention_metadata(query_lens, seq_lens, tables, self.block_size, self.device)


def run_case(case: Case, pool: Pool, kernels: list[str], args: argparse.Namespace) -> Case:
    """Time each kernel on the case (flash-attn compiled by a first call outside the timing)."""
    from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill
    from vllm_actors.kernels.triton_attention import paged_attention_varlen

    query_lens = [case.chunk] + [1] * case.decodes
    seq_lens = [case.context + case.chunk] + [case.decode_context] * case.decodes
    meta = pool.metadata(query_lens, seq_lens)
    q = torch.randn(sum(query_lens), pool.num_heads, pool.head_dim, device=pool.device, dtype=torch.bfloat16)
    scale = pool.head_dim**-0.5
    flash = FlashAttnPrefill("flash_attn", split_keys=True)
    whole = FlashAttnPrefill("flash_attn", split_keys=False)
    steps = {
        "triton": lambda: paged_attention_varlen(
            q, pool.k_cache, pool.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        ),  # fmt: skip
        "flash_attn": lambda: flash(q, pool.k_cache, pool.v_cache, meta, scale),
        # one call, no split over the keys (flash_attn_split): what the split gains
        "flash_attn_whole": lambda: whole(q, pool.k_cache, pool.v_cache, meta, scale),
    }
    outputs = {name: steps[name]().float() for name in kernels}
    if "flash_attn" in outputs and "triton" in outputs:
        case.rel_diff = float((outputs["flash_attn"] - outputs["triton"]).norm() / outputs["triton"].norm())
    del outputs
    flops = causal_flops(pool.num_heads, pool.head_dim, query_lens, seq_lens)
    for name in kernels:
        case.ms[name] = do_bench(steps[name], args)
        case.tflops[name] = flops / (case.ms[name] * 1e-3) / 1e12
    return case


def cases_for(shape: str, block_size: int, args: argparse.Namespace) -> list[Case]:
    """The grid (chunks x contexts), the long-context cases, the mixed steps."""
    grid = [Case(shape, block_size, context, chunk) for context in args.contexts for chunk in args.chunks]
    long = [Case(shape, block_size, context, args.long_chunk, kind="long") for context in args.long_contexts]
    mixed = [
        Case(shape, block_size, args.mixed_context, chunk, args.mixed_decodes, args.mixed_context, kind="mixed")
        for chunk in args.mixed_chunks
    ]
    return grid + long + (mixed if args.mixed_decodes else [])


def pool_tokens(cases: list[Case]) -> int:
    return max(c.context + c.chunk + c.decodes * c.decode_context for c in cases)


def flash_attn_missing() -> str | None:
    from vllm_actors.kernels.flash_attn_prefill import flash_attn_unavailable

    return flash_attn_unavailable(torch.device("cuda"))


def run_all(args: argparse.Namespace, log: Any) -> tuple[list[Case], str | None]:
    """Every case of every shape and block size; flash-attn's cases only where it can run."""
    missing = flash_attn_missing()
    kernels = ["triton"] if missing else ["triton", "flash_attn", "flash_attn_whole"]
    if missing:
        log.warning("flash_attn_missing_timing_triton_only", reason=missing)
    device = torch.device("cuda")
    done: list[Case] = []
    for shape in args.shapes:
        for block_size in args.block_sizes:
            cases = cases_for(shape, block_size, args)
            pool = Pool(shape, block_size, pool_tokens(cases), device)
            spin_up()
            for case in cases:
                done.append(run_case(case, pool, kernels, args))
                log.info("prefill_case", shape=shape, block_size=block_size, context=case.context, chunk=case.chunk,
                         decodes=case.decodes, ms=case.ms, speedup=case.speedup)
            del pool
            torch.cuda.empty_cache()
    return done, missing


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/prefill"), help="folder of prefill.json and prefill.md")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 128])
    p.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--contexts", type=int, nargs="+", default=[0, 4096, 16384, 32768, 65536, 131072])
    p.add_argument("--long-contexts", type=int, nargs="*", default=[1 << 20], help="one chunk over each")
    p.add_argument("--long-chunk", type=int, default=8192)
    p.add_argument("--mixed-chunks", type=int, nargs="*", default=[256, 512, 2048])
    p.add_argument("--mixed-decodes", type=int, default=63, help="decodes beside each mixed chunk (0: none)")
    p.add_argument("--mixed-context", type=int, default=4096, help="context of the mixed chunk and its decodes")
    p.add_argument("--warmup-ms", type=int, default=25)
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--max-rel-diff", type=float, default=2e-2, help="exit 1 when the kernels differ by more")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    import structlog

    from benchmarks.lib.prefill_attention_report import markdown, suggested_rule, thresholds

    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/prefill_attention.py needs a CUDA GPU; nothing was run")
    import triton

    log = structlog.get_logger("prefill_attention")
    torch.cuda.set_device(0)
    cases, missing = run_all(args, log)
    title = (
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
        f"flash-attn 4: {missing or _flash_attn_version()}; bf16, one sequence per case"
    )
    found = thresholds(cases)
    report = markdown(cases, title) + f"\nAt block size 16: `{suggested_rule(found)}`\n"
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "title": title,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "thresholds": {shape: {str(bs): t for bs, t in by_bs.items()} for shape, by_bs in found.items()},
        "cases": [{**asdict(c), "speedup": c.speedup} for c in cases],
    }
    (args.out / "prefill.json").write_text(json.dumps(payload, indent=2))
    (args.out / "prefill.md").write_text(report)
    sys.stdout.write(report + f"\nthresholds (shortest chunk flash-attn wins from): {found}\n{suggested_rule(found)}\n")
    bad = [c for c in cases if c.rel_diff is not None and not c.rel_diff <= args.max_rel_diff]
    if bad:
        sys.exit(f"{len(bad)} case(s): flash-attn and Triton differ by more than {args.max_rel_diff}")


def _flash_attn_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "installed"
