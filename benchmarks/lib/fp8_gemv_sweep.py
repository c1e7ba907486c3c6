"""``benchmarks/fp8_gemm.py --sweep-gemv``: the weight-only FP8 GEMV's launches (``Fp8GemvConfig``)
timed per projection and row count (1 to 4), each checked against the default launch's output; the
best per shape and rows goes into the tuned table (``--table-out``, a ``gemv`` object per table of
``kernels/fp8_gemm_config.py``'s format, next to the GEMM's launches). A float8 tile is half a bf16
tile's bytes, so the grid leans to wider programs than the bf16 GEMV's (16 and 32 columns, K tiles
of 512 to 2,048) with 32 to 128 accumulator elements a thread. At more than one row the kernel
loads one tile a step and nothing before its PDL wait, so launches differing only there are timed once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from vllm_actors.kernels.fp8_gemv_config import Fp8GemvConfig

# (block_n, block_k, warps, stages, tiles): 32 to 128 float32 accumulator elements a thread, two
# stages, one or two tiles a step; then deeper pipelines for four of them
FP8_GEMV_SWEEP = ([(bn, bk, w, 2, t) for bn in (8, 16, 32) for bk in (512, 1024, 2048) for w in (4, 8) for t in (1, 2)
                   if 32 <= bn * bk // (32 * w) <= 128]
                  + [(bn, bk, w, s, 2) for bn, bk, w in ((8, 1024, 4), (16, 512, 4), (16, 1024, 8), (32, 512, 8))
                     for s in (3, 4)])


def key(config: Fp8GemvConfig) -> str:
    return f"{config.block_n}x{config.block_k}w{config.warps}s{config.stages}t{config.tiles}"


def candidates(rows: int) -> list[Fp8GemvConfig]:
    """The launches tried at ``rows``: the default first, then the grid; above one row ``tiles`` is 1
    (what the kernel runs there), so launches alike but for it are one."""
    configs = [Fp8GemvConfig()] + [Fp8GemvConfig(block_n=bn, block_k=bk, warps=w, stages=s, tiles=t)
                                   for bn, bk, w, s, t in FP8_GEMV_SWEEP]
    if rows > 1:
        configs = [replace(c, tiles=1) for c in configs]
    return list(dict.fromkeys(configs))


def sweep_gemv(x: torch.Tensor, fp8: list[Any], block: tuple[int, int],
               time_fn: Callable[[Callable[[Any], Any]], float], close: Callable[[torch.Tensor, torch.Tensor], bool],
               ) -> tuple[dict[str, Any], Fp8GemvConfig]:
    """Every candidate at x's rows on the weight copies ``fp8`` ([(weight, scale), ...]): checked against
    the default launch's output (``close``), then timed (``time_fn(fn of a copy)``, us); the results
    (default, best, every time, launches that were wrong or failed) and the best launch."""
    from vllm_actors.kernels.fp8_gemv import fp8_gemv

    rows = x.shape[0]
    default = candidates(rows)[0]
    want = fp8_gemv(x, *fp8[0], block, config=default)
    timings: dict[str, float] = {}
    row: dict[str, Any] = {}
    for config in candidates(rows):
        try:
            if not close(fp8_gemv(x, *fp8[0], block, config=config), want):
                row.setdefault("gemv_wrong", []).append(key(config))
                continue
            timings[key(config)] = time_fn(lambda ws, c=config: fp8_gemv(x, *ws, block, config=c))
        except Exception as error:  # noqa: BLE001 - a launch this GPU refuses (registers, shared memory): noted
            row.setdefault("gemv_failed", {})[key(config)] = repr(error)[:160]
    best = min(timings, key=timings.__getitem__)
    chosen = next(c for c in candidates(rows) if key(c) == best)
    row.update(gemv_default_us=timings[key(default)], gemv_best_us=timings[best], gemv_best=chosen.to_json(),
               gemv_sweep_us=timings)
    return row, chosen
