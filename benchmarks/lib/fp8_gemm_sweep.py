"""``benchmarks/fp8_gemm.py --sweep``: the Triton W8A8 FP8 GEMM's launch candidates timed per Qwen3-8B
projection and row count (default 256, 2048, 8192), each checked against the current launch's
output, the best printed next to bf16 cuBLAS (and cuBLASLt's block-scaled FP8 where its probe
passes: the table's entry keeps it on at those rows unless the Triton GEMM was faster);
``--table-out PATH`` writes the tuned table the engine reads
(``kernels/fp8_gemm_config.py``'s format: commit it under ``kernels/fp8_gemm_configs/`` or point
``VLLM_ACTORS_FP8_GEMM_CONFIG`` at it), each shape's swept rows over its current table's others
(unless ``--no-merge``): the file's own where it exists (its other shapes kept), else the engine's.
About 2-3 minutes on an H100 for the four shapes at three row counts (32 launches each). With
``--sweep-gemv`` the weight-only GEMV's launches are swept too at ``--gemv-rows`` (``fp8_gemv_sweep.py``),
into the same tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.lib import fp8_gemv_sweep
from vllm_actors.kernels import fp8_gemm_config
from vllm_actors.kernels.fp8_gemm_config import GemmLaunch, GemvTable

SWEEP_ROWS = (256, 2048, 8192)
L2_DEFEAT_BYTES = 256 << 20
BLOCK = (128, 128)
# (block_m, block_n, group_m, warps, stages) from many rows: 64x128 (vLLM's tuned choice) around its
# stages and grouping, 128-row tiles over two warpgroups, 256-wide tiles
_LARGE = [(64, 64, 32, 4, 3), (64, 64, 32, 4, 4),
          (64, 128, 8, 4, 3), (64, 128, 16, 4, 4), (64, 128, 32, 4, 3), (64, 128, 32, 4, 4), (64, 128, 32, 4, 5),
          (64, 128, 64, 4, 3), (64, 128, 32, 8, 3), (64, 128, 32, 8, 4),
          (64, 256, 32, 4, 3), (64, 256, 32, 8, 3), (64, 256, 32, 8, 4),
          (128, 64, 32, 4, 3), (128, 64, 32, 4, 4), (128, 64, 32, 8, 4),
          (128, 128, 32, 4, 3), (128, 128, 32, 4, 4), (128, 128, 8, 8, 3), (128, 128, 32, 8, 3),
          (128, 128, 32, 8, 4), (128, 128, 32, 8, 5), (128, 128, 64, 8, 4),
          (128, 256, 32, 8, 3), (256, 128, 32, 8, 3), (256, 64, 32, 8, 3)]
# the same tiles loaded through tensor descriptors (TMA)
_LARGE_TMA = [(64, 128, 32, 4, 3), (64, 128, 32, 4, 4), (128, 64, 32, 4, 4), (128, 128, 32, 8, 3),
              (128, 128, 32, 8, 4), (64, 256, 32, 8, 3)]
# up to 128 rows: narrow M tiles, many column tiles (a weight read)
_SMALL = [(16, 64, 16, 4, 3), (16, 64, 16, 4, 4), (16, 64, 16, 4, 5), (16, 128, 16, 4, 4), (16, 32, 16, 4, 4),
          (16, 64, 1, 8, 4), (32, 64, 16, 4, 4), (32, 128, 16, 4, 4), (32, 128, 16, 4, 3),
          (64, 64, 32, 4, 3), (64, 64, 32, 4, 4), (64, 128, 32, 4, 3), (64, 128, 32, 4, 4), (64, 32, 16, 4, 4)]


def candidates(rows: int, tma: bool = True) -> list[GemmLaunch]:
    """The launches tried at ``rows``: the small-M list up to 128 rows, else the large one (and its
    TMA variants, tried last, unless not ``tma``); none whose M tile is more than twice the rows;
    stages that fit shared memory."""
    raw = [(*tiles, False) for tiles in (_SMALL if rows <= 128 else _LARGE)]
    raw += [(*tiles, True) for tiles in ([] if rows <= 128 or not tma else _LARGE_TMA)]
    launches = [fp8_gemm_config.fit_stages(GemmLaunch(m, n, 128, g, w, s, tma)) for m, n, g, w, s, tma in raw
                if m <= max(16, 2 * rows)]
    return list(dict.fromkeys(launches))  # fit_stages may make two alike


def tuned_file(best: dict[tuple[int, int], dict[int, GemmLaunch]], device: str, merge: bool, source: str,
               gemv: dict[tuple[int, int], GemvTable] | None = None, existing: list[Any] | None = None
               ) -> dict[str, Any]:
    """The table file of the sweep's best GEMM (``best``) and GEMV (``gemv``) launches per (N, K) and
    rows, each over the current tables' entries at rows not swept where ``merge``: those of the file
    written to (``existing``: its "tables" list, whose shapes not swept are kept as they are), else the
    engine's (``VLLM_ACTORS_FP8_GEMM_CONFIG``'s, then the shipped)."""
    gemv = gemv or {}
    existing = existing if merge else None
    text = json.dumps({"format": fp8_gemm_config.FORMAT, "tables": existing or []})
    old_gemm, old_gemv = fp8_gemm_config.parse_file(text, "the file written to")
    tables = []
    for n, k in sorted(set(best) | set(gemv)):
        key = (n, k, fp8_gemm_config.block_key(BLOCK), device)
        current = old_gemm.get(key, fp8_gemm_config.tuned_table(n, k, BLOCK, device)) if merge else None
        current_gemv = old_gemv.get(key, fp8_gemm_config.tuned_gemv_table(n, k, BLOCK, device)) if merge else None
        configs = {**(current or {}), **best.get((n, k), {})}
        tables.append(fp8_gemm_config.table_json(n, k, BLOCK, device, configs, source=source,
                                                 gemv={**(current_gemv or {}), **gemv.get((n, k), {})}))
    swept = {(t["n"], t["k"], t["block"] and tuple(t["block"]), t["device"]) for t in tables}
    kept = [t for t in existing or [] if (t["n"], t["k"], t["block"] and tuple(t["block"]), t["device"]) not in swept]
    return {"format": fp8_gemm_config.FORMAT, "tables": kept + tables}


def existing_tables(path: str | None, merge: bool) -> list[Any] | None:
    """The "tables" of the file at ``path`` where it exists and ``merge`` (checked now, before a sweep
    spends its time: a ValueError if the engine could not read it)."""
    if not path or not merge or not Path(path).exists():
        return None
    text = Path(path).read_text()
    fp8_gemm_config.parse_file(text, path)
    tables: list[Any] = json.loads(text)["tables"]
    return tables


def write_table(args: argparse.Namespace, tuned: dict[str, Any]) -> None:
    """``tuned`` checked as the engine will read it, then written to ``--table-out``."""
    fp8_gemm_config.parse_file(fp8_gemm_config.dumps(tuned), "the sweep's table")
    Path(args.table_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.table_out).write_text(fp8_gemm_config.dumps(tuned))
    print(f"the table is at {args.table_out} (VLLM_ACTORS_FP8_GEMM_CONFIG={args.table_out}, or commit it under "
          "src/vllm_actors/kernels/fp8_gemm_configs/)", flush=True)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)) < 1e-2


def _time(fn: Any, items: list[Any], calls: int, args: argparse.Namespace) -> float:
    """us per call of ``fn(item)``, each call on the next item (weight copy), from a CUDA graph."""
    from benchmarks.lib.kernels_timing import do_bench_graph

    turn = itertools.cycle(items)
    return do_bench_graph(lambda: fn(next(turn)), args, calls=calls) * 1e3


def _key(launch: GemmLaunch) -> str:
    return json.dumps(launch.to_json(), separators=(",", ":"))


def _sweep_one(name: str, n: int, k: int, rows: int, bf16: list[torch.Tensor], fp8: list[Any], scaled_mm: bool,
               device: str, args: argparse.Namespace) -> tuple[dict[str, Any], GemmLaunch]:
    """One shape at one row count: bf16, the current launch and every candidate (checked, then timed)."""
    from vllm_actors.kernels.fp8_gemm import Fp8GemmConfig, fp8_linear

    x = torch.randn((rows, k), device=fp8[0][0].device, dtype=torch.bfloat16)
    calls = 20 if rows <= 2048 else 5
    current = replace(fp8_gemm_config.choose_launch(rows, n, k, BLOCK, device), cublas=True)  # the Triton part
    want = fp8_linear(x, *fp8[0], BLOCK, config=Fp8GemmConfig(launch=current, scaled_mm=False))
    row: dict[str, Any] = {"name": name, "n": n, "k": k, "rows": rows,
                           "bf16_us": _time(lambda w: F.linear(x, w), bf16, calls, args)}
    if scaled_mm:
        cublas = Fp8GemmConfig(launch=current)  # cublas=True: torch._scaled_mm whatever the table says
        row["scaled_mm_us"] = _time(lambda ws: fp8_linear(x, *ws, BLOCK, config=cublas), fp8, calls, args)
    timings: dict[str, float] = {}
    for launch in [current] + [c for c in candidates(rows, tma=not args.no_tma) if c != current]:
        config = Fp8GemmConfig(launch=launch, scaled_mm=False)
        try:
            if not _close(fp8_linear(x, *fp8[0], BLOCK, config=config), want):
                row.setdefault("wrong", []).append(_key(launch))
                continue
            timings[_key(launch)] = _time(lambda ws, c=config: fp8_linear(x, *ws, BLOCK, config=c), fp8, calls, args)
        except Exception as error:  # noqa: BLE001 - a launch this GPU refuses (shared memory): noted
            row.setdefault("failed", {})[_key(launch)] = repr(error)[:160]
    chosen = min(timings, key=timings.__getitem__)
    row.update(current_us=timings[_key(current)], best_us=timings[chosen], best=json.loads(chosen),
               sweep_us=timings)
    launch = fp8_gemm_config.parse_launch(json.loads(chosen), "sweep")
    # cuBLASLt stays on at these rows unless the Triton GEMM measured faster than it
    return row, replace(launch, cublas=not scaled_mm or row["scaled_mm_us"] <= row["best_us"])


def run(projections: list[tuple[str, int, int]], args: argparse.Namespace) -> int:
    from vllm_actors.kernels import fp8_scaled_mm
    from vllm_actors.kernels.fp8_gemm import quantize_activations, quantize_weight

    device = torch.cuda.get_device_name()
    started = time.monotonic()
    rows_list = args.rows if args.rows_given else list(SWEEP_ROWS)
    scaled_mm = fp8_scaled_mm.layout(torch.device("cuda"), lambda a, col: quantize_activations(a, BLOCK[1], col))
    existing = existing_tables(args.table_out, not args.no_merge)
    best: dict[tuple[int, int], dict[int, GemmLaunch]] = {}
    gemv: dict[tuple[int, int], GemvTable] = {}
    results: list[dict[str, Any]] = []
    for name, n, k in projections:
        copies = max(2, -(-L2_DEFEAT_BYTES // (n * k)))
        bf16 = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        fp8 = [quantize_weight(w, BLOCK) for w in bf16]
        for rows in rows_list:
            if time.monotonic() - started > args.budget_s:
                print(f"budget of {args.budget_s:.0f} s spent: {name} at {rows} rows and after not swept", flush=True)
                break
            row, launch = _sweep_one(name, n, k, rows, bf16, fp8, scaled_mm is not None, device, args)
            best.setdefault((n, k), {})[rows] = launch
            results.append(row)
            scaled = f", scaled_mm {row['scaled_mm_us']:.1f}" if "scaled_mm_us" in row else ""
            print(f"{name} {n}x{k} rows {rows}: bf16 {row['bf16_us']:.1f} us{scaled}, triton current "
                  f"{row['current_us']:.1f}, best {row['best_us']:.1f} {_key(launch)}", flush=True)
        for rows in args.gemv_rows if args.sweep_gemv else []:
            x = torch.randn((rows, k), device="cuda", dtype=torch.bfloat16)
            gemv_row, config = fp8_gemv_sweep.sweep_gemv(x, fp8, BLOCK, lambda fn, ws=fp8: _time(fn, ws, 20, args),
                                                         _close)
            gemv.setdefault((n, k), {})[rows] = config
            results.append({"name": name, "n": n, "k": k, "rows": rows, **gemv_row})
            print(f"{name} {n}x{k} rows {rows}: GEMV default {gemv_row['gemv_default_us']:.1f} us, best "
                  f"{gemv_row['gemv_best_us']:.1f} {fp8_gemv_sweep.key(config)}", flush=True)
        del bf16, fp8
    swept = f"rows {rows_list}" + (f", GEMV rows {args.gemv_rows}" if args.sweep_gemv else "")
    tuned = tuned_file(best, device, merge=not args.no_merge, gemv=gemv, existing=existing,
                       source=f"benchmarks/fp8_gemm.py --sweep, {swept}, {time.strftime('%Y-%m-%d')}")
    fp8_gemm_config.parse_file(fp8_gemm_config.dumps(tuned), "the sweep's table")  # what the engine will read
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": device, "results": results, "table": tuned}, indent=1) + "\n")
    if args.table_out:
        write_table(args, tuned)
    print(f"sweep: {time.monotonic() - started:.0f} s", flush=True)
    return 0
