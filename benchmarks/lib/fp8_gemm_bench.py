"""Qwen3-8B's projections (TP=1) at several row counts: bf16 cuBLAS (``F.linear``) against the
Triton FP8 GEMM with block-wise [128, 128] scales (`kernels/fp8_gemm.py`: the activation
quantization included), and vLLM's ``per_token_group_quant_fp8`` + ``w8a8_block_fp8_matmul`` where
vllm imports. One GPU.

    python benchmarks/fp8_gemm.py [--rows 1 16 64 256 1024 4096] [--sweep] [--out fp8_gemm.json]

Each call is timed from a CUDA graph of 20 calls cycling through enough weight copies (256 MB or
more) that none is found in L2. ``--sweep`` also times a grid of GEMM tiles and GEMV widths and
prints the best per row count (to write into ``Fp8GemmConfig``).
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

PROJECTIONS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
BLOCK = (128, 128)
L2_DEFEAT_BYTES = 256 << 20
TILES = [(m, n, w, s) for m, n in ((16, 64), (16, 128), (32, 128), (64, 64), (64, 128), (128, 128))
         for w in (4, 8) for s in (3, 4)]
GEMV_COLUMNS = (8, 16, 32, 64)


def _timer(fn_of: Any, items: list[Any], args: argparse.Namespace) -> float:
    turn = itertools.cycle(items)
    return do_bench_graph(lambda: fn_of(next(turn)), args) * 1e3  # us


def _vllm_fp8() -> Any:
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            per_token_group_quant_fp8,
            w8a8_block_fp8_matmul,
        )
    except Exception:  # noqa: BLE001 - vllm absent or of another layout: its column is left out
        return None

    def run(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x_q, x_s = per_token_group_quant_fp8(x, BLOCK[1])
        return w8a8_block_fp8_matmul(x_q, w, x_s, s, list(BLOCK), output_dtype=x.dtype)

    return run


def main(argv: list[str] | None = None) -> int:
    from vllm_actors.kernels.fp8_gemm import Fp8GemmConfig, fp8_linear, quantize_weight

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles")
    parser.add_argument("--out", default="results/fp8_gemm.json")
    parser.add_argument("--warmup-ms", type=float, default=5.0)
    parser.add_argument("--rep-ms", type=float, default=20.0)
    args = parser.parse_args(argv)
    spin_up()
    vllm_run = _vllm_fp8()
    results: list[dict[str, Any]] = []
    for name, n, k in PROJECTIONS:
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))
        bf16 = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        fp8 = [quantize_weight(w, BLOCK) for w in bf16]
        for rows in args.rows:
            x = torch.randn((rows, k), device="cuda", dtype=torch.bfloat16)
            row: dict[str, Any] = {"name": name, "n": n, "k": k, "rows": rows,
                                   "bf16_us": _timer(lambda w, x=x: F.linear(x, w), bf16, args),
                                   "fp8_us": _timer(lambda ws, x=x: fp8_linear(x, *ws, BLOCK), fp8, args)}
            if vllm_run is not None:
                try:
                    row["vllm_fp8_us"] = _timer(lambda ws, x=x, run=vllm_run: run(x, *ws), fp8, args)
                except Exception as error:  # noqa: BLE001 - another vllm's signature: noted, not fatal
                    row["vllm_fp8_error"], vllm_run = repr(error)[:200], None
            if args.sweep:
                configs = ([Fp8GemmConfig(gemv_columns=c) for c in GEMV_COLUMNS] if rows == 1 else
                           [Fp8GemmConfig(small_rows=0, large=tile) for tile in TILES])
                timed = {str(c.gemv_columns if rows == 1 else c.large):
                         _timer(lambda ws, x=x, c=c: fp8_linear(x, *ws, BLOCK, config=c), fp8, args) for c in configs}
                row["sweep_us"] = timed
                row["best"] = min(timed, key=timed.__getitem__)
            results.append(row)
            print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "block": BLOCK, "results": results},
                              indent=2) + "\n")
    return 0
