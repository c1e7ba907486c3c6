"""Qwen3-8B's projections (TP=1) at several row counts: bf16 (cuBLAS ``F.linear`` and, up to 4 rows,
the bf16 GEMV of `kernels/gemv.py`) against FP8 weights with block-wise [128, 128] scales: the
weight-only GEMV (`kernels/fp8_gemv.py`, up to 4 rows, activations not quantized), the W8A8 path
(`kernels/fp8_gemm.py`: activation quantization + Triton GEMM, or its one-row GEMV), the same
quantization + cuBLASLt's block-scaled GEMM (``torch._scaled_mm``, `kernels/fp8_scaled_mm.py`, where
its probe passes) and vLLM's ``per_token_group_quant_fp8`` + ``w8a8_block_fp8_matmul`` (Triton) and
``cutlass_scaled_mm`` where vllm imports (``--vllm-site``). One GPU.

    python benchmarks/fp8_gemm.py [--rows 1 2 4 8] [--sweep-gemv [--table-out PATH]] [--out fp8_gemm.json]
    python benchmarks/fp8_gemm.py --sweep [--rows 256 2048 8192] [--sweep-gemv [--gemv-rows 1 2]] [--table-out PATH]

Each call is timed from a CUDA graph of 20 calls cycling through enough weight copies (256 MB or
more) that none is found in L2; each time also as GB/s of the bytes the call reads and writes
(weight, scales, activations, output). At one row the down projection is also timed reading
SiLU(gate) * up itself (``*_silu``, both GEMVs). ``--sweep-gemv`` also times the weight-only GEMV's
launches up to 4 rows (``benchmarks/lib/fp8_gemv_sweep.py``) and, with ``--table-out``, writes the
best per shape and rows into the tuned table the engine reads (``VLLM_ACTORS_FP8_GEMM_CONFIG``).
``--sweep`` tunes the Triton GEMM's launch table instead (``benchmarks/lib/fp8_gemm_sweep.py``), and
the GEMV's too at ``--gemv-rows`` with ``--sweep-gemv``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.lib import fp8_gemm_sweep, fp8_gemv_sweep
from benchmarks.lib.kernels_timing import do_bench_graph, spin_up

PROJECTIONS = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288)]
BLOCK = (128, 128)
L2_DEFEAT_BYTES = 256 << 20
FP8_GEMV_SWEEP = fp8_gemv_sweep.FP8_GEMV_SWEEP  # the weight-only GEMV's (block_n, block_k, warps, stages, tiles)


def _timer(fn_of: Any, items: list[Any], args: argparse.Namespace) -> float:
    turn = itertools.cycle(items)
    return do_bench_graph(lambda: fn_of(next(turn)), args) * 1e3  # us


def _w8a8(fn: Callable[[], Any]) -> Any:
    """``fn()`` with the weight-only GEMV off: ``fp8_linear`` takes its W8A8 paths at every row count."""
    before = os.environ.get("VLLM_ACTORS_FP8_GEMV_ROWS")
    os.environ["VLLM_ACTORS_FP8_GEMV_ROWS"] = "0"
    try:
        return fn()
    finally:
        if before is None:
            del os.environ["VLLM_ACTORS_FP8_GEMV_ROWS"]
        else:
            os.environ["VLLM_ACTORS_FP8_GEMV_ROWS"] = before


def _vllm_fp8() -> dict[str, Any]:
    """vLLM's Triton block GEMM and, where its custom ops load, its CUTLASS one (what it runs on Hopper)."""
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            per_token_group_quant_fp8,
            w8a8_block_fp8_matmul,
        )
    except Exception as error:  # noqa: BLE001 - vllm absent or of another layout: its columns are left out
        print(f"vllm: not imported ({error!r:.200})", flush=True)
        return {}

    def triton_run(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x_q, x_s = per_token_group_quant_fp8(x, BLOCK[1])
        return w8a8_block_fp8_matmul(x_q, w, x_s, s, list(BLOCK), output_dtype=x.dtype)

    def cutlass_run(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        from vllm import _custom_ops as ops

        x_q, x_s = per_token_group_quant_fp8(x, BLOCK[1], column_major_scales=True)
        return ops.cutlass_scaled_mm(x_q, w.t(), out_dtype=x.dtype, scale_a=x_s, scale_b=s.t())

    return {"vllm_fp8": triton_run, "vllm_cutlass": cutlass_run}


def _bytes(rows: int, n: int, k: int, weight_bytes: int, scale_bytes: int, x_width: int) -> int:
    return n * k * weight_bytes + scale_bytes + rows * x_width * 2 + rows * n * 2


def _with_gbps(row: dict[str, Any], moved: dict[str, int]) -> None:
    """``<column>_gbps`` next to each ``<column>_us``: GB/s of the bytes that column's call moves."""
    for key, value in list(row.items()):
        if key.endswith("_us") and isinstance(value, float):
            column = key.removesuffix("_us")
            row[f"{column}_gbps"] = round(moved["bf16" if column.startswith("bf16") else "fp8"] / value / 1e3, 1)


def _measure(name: str, n: int, k: int, rows: int, bf16: list[torch.Tensor], fp8: list[Any],
             vllm_runs: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    from vllm_actors.kernels import fp8_gemm_config, fp8_scaled_mm
    from vllm_actors.kernels.fp8_gemm import Fp8GemmConfig, fp8_linear, quantize_activations
    from vllm_actors.kernels.fp8_gemv import fp8_gemv
    from vllm_actors.kernels.gemv import gemv

    x = torch.randn((rows, k), device="cuda", dtype=torch.bfloat16)
    row: dict[str, Any] = {"name": name, "n": n, "k": k, "rows": rows,
                           "bf16_us": _timer(lambda w: F.linear(x, w), bf16, args)}
    if rows <= 4:
        row["bf16_gemv_us"] = _timer(lambda w: gemv(x, w), bf16, args)
        row["fp8_gemv_us"] = _timer(lambda ws: fp8_gemv(x, *ws, BLOCK), fp8, args)
    triton_only = Fp8GemmConfig(scaled_mm=False)
    row["fp8_w8a8_us"] = _w8a8(lambda: _timer(lambda ws: fp8_linear(x, *ws, BLOCK, config=triton_only), fp8, args))
    if rows > 1 and fp8_scaled_mm.layout(x.device, lambda a, column: quantize_activations(a, BLOCK[1], column)):
        launch = fp8_gemm_config.choose_launch(rows, n, k, BLOCK, torch.cuda.get_device_name())
        cublas = Fp8GemmConfig(launch=dataclasses.replace(launch, cublas=True))  # whatever the table says
        row["fp8_scaled_mm_us"] = _w8a8(lambda: _timer(lambda ws: fp8_linear(x, *ws, BLOCK, config=cublas), fp8, args))
    for column, run in vllm_runs.items():
        try:
            row[f"{column}_us"] = _timer(lambda ws, run=run: run(x, *ws), fp8, args)
        except Exception as error:  # noqa: BLE001 - another vllm's signature: noted, not fatal
            row[f"{column}_error"] = repr(error)[:200]
    if name == "down" and rows == 1:  # x is [gate | up]: the product reads SiLU(gate) * up
        gate_up = torch.randn((1, 2 * k), device="cuda", dtype=torch.bfloat16)
        row["bf16_gemv_silu_us"] = _timer(lambda w: gemv(gate_up, w, silu_mul=True), bf16, args)
        row["fp8_gemv_silu_us"] = _timer(lambda ws: fp8_gemv(gate_up, *ws, BLOCK, silu_mul=True), fp8, args)
    scales = fp8[0][1].numel() * 4
    _with_gbps(row, {"bf16": _bytes(rows, n, k, 2, 0, k), "fp8": _bytes(rows, n, k, 1, scales, k)})
    if args.sweep_gemv and rows <= 4:
        swept, config = fp8_gemv_sweep.sweep_gemv(x, fp8, BLOCK, lambda fn: _timer(fn, fp8, args),
                                                  fp8_gemm_sweep._close)
        row.update(swept)
        return row, config
    return row, None


def _summary(results: list[dict[str, Any]]) -> list[str]:
    """Per row count: each column's GB/s over the four projections' summed bytes and times."""
    lines = []
    for rows in sorted({r["rows"] for r in results}):
        of_rows = [r for r in results if r["rows"] == rows]
        columns = [c for c in of_rows[0] if c.endswith("_us") and "silu" not in c
                   and all(isinstance(r.get(c), float) for r in of_rows)]
        total = {c: sum(r[c] for r in of_rows) for c in columns}
        cells = [f"{c.removesuffix('_us')} {total[c]:.1f} us" for c in columns]
        lines.append(f"rows {rows}: " + ", ".join(cells) + f"; fastest {min(total, key=total.__getitem__)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    from vllm_actors.kernels.fp8_gemm import quantize_weight

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=None,
                        help="row counts (default 1 2 4 8; with --sweep 256 2048 8192)")
    parser.add_argument("--shapes", nargs="+", choices=[name for name, _, _ in PROJECTIONS],
                        default=[name for name, _, _ in PROJECTIONS])
    parser.add_argument("--sweep-gemv", action="store_true", help="also time the weight-only GEMV's launch grid")
    parser.add_argument("--sweep", action="store_true",
                        help="tune the Triton GEMM's launches per shape and rows instead (lib/fp8_gemm_sweep.py)")
    parser.add_argument("--gemv-rows", type=int, nargs="+", default=[1, 2],
                        help="with --sweep --sweep-gemv: the GEMV's row counts (1 to 4; default 1 2)")
    parser.add_argument("--table-out", default=None,
                        help="with --sweep or --sweep-gemv: write the tuned table here (merged over what it holds)")
    parser.add_argument("--no-merge", action="store_true",
                        help="with --table-out: the table holds the swept rows alone (default: over the current table)")
    parser.add_argument("--budget-s", type=float, default=220.0, help="with --sweep: no new row count past this")
    parser.add_argument("--no-tma", action="store_true", help="with --sweep: leave out the launches loading by TMA")
    parser.add_argument("--out", default=None, help="results JSON (default results/fp8_gemm[_sweep].json)")
    parser.add_argument("--warmup-ms", type=float, default=None, help="default 5 (1 with --sweep)")
    parser.add_argument("--rep-ms", type=float, default=None, help="default 20 (5 with --sweep)")
    parser.add_argument("--vllm-site", default="/tmp/vsite",
                        help="appended to sys.path for vLLM's columns where it exists (after this site's packages)")
    args = parser.parse_args(argv)
    if args.table_out and not (args.sweep or args.sweep_gemv):
        parser.error("--table-out needs --sweep or --sweep-gemv")
    if not all(1 <= rows <= 4 for rows in args.gemv_rows):
        parser.error(f"--gemv-rows must be 1 to 4 (the GEMV's rows), got {args.gemv_rows}")
    args.rows_given = args.rows is not None
    args.rows = args.rows or [1, 2, 4, 8]
    args.warmup_ms = args.warmup_ms if args.warmup_ms is not None else (1.0 if args.sweep else 5.0)
    args.rep_ms = args.rep_ms if args.rep_ms is not None else (5.0 if args.sweep else 20.0)
    args.out = args.out or ("results/fp8_gemm_sweep.json" if args.sweep else "results/fp8_gemm.json")
    projections = [p for p in PROJECTIONS if p[0] in args.shapes]
    if args.sweep:
        spin_up()
        return fp8_gemm_sweep.run(projections, args)
    if args.vllm_site and Path(args.vllm_site, "vllm").is_dir():
        sys.path.append(args.vllm_site)
    existing = fp8_gemm_sweep.existing_tables(args.table_out, not args.no_merge)  # checked before the sweep
    spin_up()
    vllm_runs = _vllm_fp8()
    results: list[dict[str, Any]] = []
    gemv: dict[tuple[int, int], Any] = {}
    for name, n, k in projections:
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))
        bf16 = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        fp8 = [quantize_weight(w, BLOCK) for w in bf16]
        for rows in args.rows:
            row, best = _measure(name, n, k, rows, bf16, fp8, vllm_runs, args)
            if best is not None:
                gemv.setdefault((n, k), {})[rows] = best
            results.append(row)
            print(json.dumps(row), flush=True)
        del bf16, fp8
    summary = _summary(results)
    print("\n".join(summary), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "block": BLOCK, "results": results,
                               "summary": summary}, indent=2) + "\n")
    if args.table_out:
        source = f"benchmarks/fp8_gemm.py --sweep-gemv, rows {sorted({r for t in gemv.values() for r in t})}, " \
                 f"{time.strftime('%Y-%m-%d')}"
        fp8_gemm_sweep.write_table(args, fp8_gemm_sweep.tuned_file(
            {}, torch.cuda.get_device_name(), merge=not args.no_merge, source=source, gemv=gemv, existing=existing))
    return 0
