"""GPU microbenchmark of the Triton paged-attention kernels against torch references.

At Qwen3-0.6B's attention shape (16 query heads, 8 KV heads, head_dim 128), bf16, block size 16:

* decode, batch {1, 64, 256} x context {512, 2048}: the Triton decode kernel (with its split
  reduce) against SDPA on KV gathered through the block tables (gather included), SDPA alone on
  KV gathered beforehand, and the project's torch reference backend (a Python loop over
  sequences). Decode is also timed inside CUDA graphs (how the engine runs it), which removes the
  Python launch cost that dominates small batches. GB/s counts the KV bytes the step must read;
* prefill of 8 sequences x 1024 new tokens: Triton varlen against causal SDPA; TFLOP/s counts the
  causal half only (4 * D flops per visible query-key pair);
* a chunked-prefill step (one 512-token chunk on a 1536-token prefix beside 63 decodes at 2048):
  the Triton varlen kernel against the torch reference backend;
* the KV write of each batch's new tokens.

Every case checks the Triton output against a float32 torch computation. Times are medians of
`triton.testing.do_bench`, in milliseconds. Usage:

    python benchmarks/kernel_micro.py [--out results/kernels.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import structlog
import torch

from benchmarks.lib.kernels_attention import Row, bench_decode, bench_mixed, bench_prefill
from benchmarks.lib.kernels_fused import bench_fused, format_fused
from benchmarks.lib.kernels_timing import DTYPES

log = structlog.get_logger(__name__)


COLUMNS = ["triton", "triton_graph", "gather_sdpa", "gather_sdpa_graph", "sdpa_only", "torch_loop", "kv_write"]


def format_table(rows: list[Row]) -> str:
    head = f"{'kind':<8}{'B':>5}{'ctx':>6}{'split':>6}" + "".join(f"{c:>18}" for c in COLUMNS)
    head += f"{'metric':>18}{'rel err':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f"{r.ms[c]:>18.4f}" if c in r.ms else f"{'-':>18}" for c in COLUMNS)
        lines.append(
            f"{r.kind:<8}{r.batch:>5}{r.context:>6}{(r.num_splits or '-'):>6}{cells}"
            f"{r.metric:>10.1f} {r.metric_unit:<7}{r.rel_err:>9.1e}"
        )
    lines.append(
        "times in ms (medians); *_graph: per call replayed from a CUDA graph; metric: the Triton kernel's rate "
        "(decode from triton_graph)"
    )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--prefill", type=int, nargs=2, default=[8, 1024], metavar=("BATCH", "LENGTH"))
    p.add_argument("--no-mixed", action="store_true", help="skip the chunked-prefill case")
    p.add_argument("--no-fused", action="store_true", help="skip the fused elementwise kernels")
    p.add_argument("--fused-tokens", type=int, nargs="+", default=[1, 64, 8192])
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--intermediate-size", type=int, default=3072)
    p.add_argument("--sweep-splits", type=int, nargs="*", default=[], help="also time these decode split counts")
    p.add_argument("--torch-backend-max-batch", type=int, default=64, help="skip the torch loop above this batch")
    p.add_argument("--warmup-ms", type=int, default=50)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--max-rel-err", type=float, default=2e-2, help="exit 1 when a case's error is above this")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/kernel_micro.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run")
    try:
        import triton
    except ImportError:
        sys.exit("benchmarks/kernel_micro.py needs triton (pip install 'vllm_actors[kernels]')")
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[Row] = []
    sweep: list[Row] = []
    for batch in args.batches:
        for context in args.contexts:
            rows.append(bench_decode(batch, context, args, device))
            log.info("decode_case_done", batch=batch, context=context, ms=rows[-1].ms["triton_graph"])
            for splits in args.sweep_splits:
                sweep.append(bench_decode(batch, context, args, device, splits=splits))
    batch, length = args.prefill
    rows.append(bench_prefill(batch, length, args, device))
    if not args.no_mixed:
        rows.append(bench_mixed(args, device))
    title = (
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{args.dtype}, block size {args.block_size}, heads {args.num_heads}/{args.num_kv_heads}, "
        f"head_dim {args.head_dim}"
    )
    sys.stdout.write(f"{title}\n{format_table(rows)}\n")
    if sweep:
        sys.stdout.write(f"decode split sweep\n{format_table(sweep)}\n")
    fused = [] if args.no_fused else bench_fused(args, device)
    if fused:
        sys.stdout.write(f"fused elementwise kernels (ms per call from CUDA graphs)\n{format_fused(fused)}\n")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "title": title,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "rows": [asdict(r) for r in rows],
            "split_sweep": [asdict(r) for r in sweep],
            "fused": [asdict(r) for r in fused],
        }
        args.out.write_text(json.dumps(payload, indent=2))
    bad = [r for r in rows + sweep if not r.rel_err <= args.max_rel_err]
    if bad:
        sys.exit(f"{len(bad)} case(s) differ from the torch reference by more than {args.max_rel_err}")

