"""The batch-1 projections of a model shape: cuBLAS (``F.linear``) against the Triton GEMV
(`kernels/gemv.py`) for a grid of launch parameters, one GPU.

    python benchmarks/gemv_sweep.py [--shape qwen3-8b] [--tp 1 2] [--out gemv.json]

Each projection of a decoder layer at each tensor-parallel size (``qkv``, ``o``, ``gate_up``,
``down``, and the LM head, split as `models/parallel.py` splits them) is timed from a CUDA graph of
20 calls that cycle through enough copies of the weight (256 MB or more) that no call finds it in
L2. The grid's best configuration is the one with the least time summed over all shapes at M=1,
each weighted by how often a token runs it (every layer's, once the head); it is then timed at M=2
and 4, and printed as the ``GemvConfig`` defaults to write into `kernels/gemv.py`.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.lib.kernels_timing import do_bench_graph, spin_up

SHAPES = {  # hidden, heads, kv heads, head dim, intermediate, vocabulary, layers
    "qwen3-8b": (4096, 32, 8, 128, 12288, 151936, 36),
    "qwen3-0.6b": (1024, 16, 8, 128, 3072, 151936, 28),
}
GRID = {"block_n": (8, 16, 32), "block_k": (256, 512, 1024), "warps": (4, 8), "stages": (2, 4)}
L2_DEFEAT_BYTES = 256 << 20


def projections(shape: str, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, N, K, calls per token) of every projection of one rank."""
    hidden, heads, kv, dim, inter, vocab, layers = SHAPES[shape]
    q, kv_rank = heads * dim // tp, max(1, kv // tp) * dim
    return [("qkv", q + 2 * kv_rank, hidden, layers), ("o", hidden, heads * dim // tp, layers),
            ("gate_up", 2 * inter // tp, hidden, layers), ("down", hidden, inter // tp, layers),
            ("lm_head", -(-vocab // tp), hidden, 1)]


def _timer(fn_of_weight: Any, weights: list[torch.Tensor], args: argparse.Namespace) -> float:
    turn = itertools.cycle(weights)
    return do_bench_graph(lambda: fn_of_weight(next(turn)), args) * 1e3  # us


def main(argv: list[str] | None = None) -> int:
    from vllm_actors.kernels.gemv import GemvConfig, gemv

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", default="results/gemv.json")
    parser.add_argument("--warmup-ms", type=float, default=5.0)
    parser.add_argument("--rep-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    dtype = torch.bfloat16
    spin_up()
    configs = [GemvConfig(*values) for values in itertools.product(*GRID.values())]
    cases = [(tp, *p) for tp in args.tp for p in projections(args.shape, tp)]
    rows: list[dict[str, Any]] = []
    totals = {c: 0.0 for c in configs}
    cublas_total = 0.0
    for tp, name, n, k, per_token in cases:
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
        weights = [torch.randn((n, k), device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        x = torch.randn((1, k), device=device, dtype=dtype)
        want = F.linear(x.double(), weights[0].double())
        row: dict[str, Any] = {"tp": tp, "name": name, "n": n, "k": k, "per_token": per_token,
                               "cublas_us": _timer(lambda w, x=x: F.linear(x, w), weights, args)}
        cublas_total += row["cublas_us"] * per_token
        for config in configs:
            got = gemv(x, weights[0], config=config).double()
            if float((got - want).abs().max()) > 1e-2 * float(want.abs().max()):
                raise SystemExit(f"gemv {config} wrong on {name} {n}x{k}")
            us = _timer(lambda w, x=x, c=config: gemv(x, w, config=c), weights, args)
            totals[config] += us * per_token
            row.setdefault("gemv_us", {})[str(config)] = us
        best = min(row["gemv_us"], key=row["gemv_us"].get)
        us = row["gemv_us"][best]
        print(f"tp={tp} {name:8s} {n:6d}x{k:5d}  cuBLAS {row['cublas_us']:7.2f} us  best gemv {us:7.2f} us "
              f"({best}, {n * k * 2 / us / 1e6:.2f} TB/s)", flush=True)
        rows.append(row)
        del weights
    best_config = min(totals, key=totals.__getitem__)
    print(f"per token over tp {args.tp}: cuBLAS {cublas_total:.0f} us, best gemv {totals[best_config]:.0f} us "
          f"with {best_config}")
    wider = []
    for tp, name, n, k, _ in cases:  # the best configuration at M = 2 and 4
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k * 2)))
        weights = [torch.randn((n, k), device=device, dtype=dtype) * 0.02 for _ in range(copies)]
        for m in (2, 4):
            x = torch.randn((m, k), device=device, dtype=dtype)
            entry = {"tp": tp, "name": name, "m": m, "cublas_us": _timer(lambda w, x=x: F.linear(x, w), weights, args),
                     "gemv_us": _timer(lambda w, x=x: gemv(x, w, config=best_config), weights, args)}
            wider.append(entry)
            print(f"tp={tp} {name:8s} M={m}: cuBLAS {entry['cublas_us']:7.2f} us, gemv {entry['gemv_us']:7.2f} us")
        del weights
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"shape": args.shape, "device": torch.cuda.get_device_name(),
                                          "best": str(best_config), "cublas_total_us": cublas_total,
                                          "best_total_us": totals[best_config], "rows": rows, "wider": wider},
                                         indent=1))
    print(f"best: {best_config} (GemvConfig's defaults in kernels/gemv.py)")
    return 0

