"""Sweep of the Triton decode kernel's launch parameters over realistic batches (needs a CUDA GPU).

The kernel microbenchmark (`benchmarks.lib.kernel_micro`) times decode at uniform context lengths,
where every program of the grid does the same work. A serving batch is not like that: in
nano-vllm's workload (prompts and outputs of 100-1,024 tokens, all requests at once) the batch
shrinks from 256 sequences to a few as requests finish, and contexts differ by up to 10x. Programs
of unequal length leave SMs idle in the last wave, and a shrinking batch leaves fewer programs
than the GPU has slots.

This replays that workload's decode batches at evenly spaced steps (each snapshot: the sequences
still running and their context lengths), and for each times the decode kernel, replayed from a
CUDA graph, for every (split count, tile config) of a grid. The sum over snapshots approximates
the decode attention time of the whole run, so a change of default is judged on it.

    python benchmarks/decode_sweep.py --out results/decode_sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.lib.kernels_attention import _reference, _rel_err, _setup
from benchmarks.lib.kernels_timing import do_bench_graph, spin_up


@dataclass
class Cell:
    shape: str
    step: int
    batch: int
    mean_context: float
    splits: int
    block_n: int
    num_warps: int
    num_stages: int
    ordered: bool
    ms: float
    tbps: float


def workload_snapshots(num_requests: int, steps: list[int], seed: int) -> dict[int, list[int]]:
    """Context lengths of the sequences still decoding at each step of nano-vllm's workload."""
    rng = random.Random(seed)
    reqs = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(num_requests)]
    return {t: [p + t for p, o in reqs if o > t] for t in steps}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--shapes", nargs="+", default=["16/8", "16/4"], help="query heads / KV heads (per rank)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--steps", type=int, nargs="+", default=[50, 250, 450, 650, 850, 950])
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    p.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--orders", type=int, nargs="+", default=[0, 1], help="1: longest context first")
    p.add_argument("--warmup-ms", type=int, default=20)
    p.add_argument("--rep-ms", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _sweep_snapshot(
    args: argparse.Namespace, shape: str, step: int, lens: list[int], device: torch.device
) -> list[Cell]:
    """Time every (splits, tile config) of the grid on one batch; skip configs that do not compile."""
    from vllm_actors.kernels import triton_attention as ta

    kv_heads = args.num_kv_heads
    s = _setup([1] * len(lens), lens, args, device, seed=step)
    meta = s.meta
    scale = args.head_dim**-0.5
    out = torch.empty_like(s.q)
    ref = _reference(s, scale)
    kv_bytes = 2 * sum(lens) * kv_heads * args.head_dim * 2
    cells: list[Cell] = []
    order = torch.argsort(meta.seq_lens, descending=True)
    grid = itertools.product(args.splits, args.block_n, args.warps, args.stages, args.orders)
    for splits, bn, warps, stages, ordered in grid:
        cfg = ta.TileConfig(block_m=16, block_n=bn, num_warps=warps, num_stages=stages)

        def step_fn(splits: int = splits, cfg: ta.TileConfig = cfg, ordered: int = ordered) -> torch.Tensor:
            return ta.paged_attention_decode(
                s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                meta.max_seq_len, scale, out=out, num_splits=splits, config=cfg,
                order=order if ordered else None,
            )  # fmt: skip

        try:
            err = _rel_err(step_fn(), ref)
            if not err < 2e-2:
                print(f"WRONG {shape} step {step} {splits} {cfg}: rel err {err:.2e}", flush=True)
                continue
            ms = do_bench_graph(step_fn, args, calls=10)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
            print(f"skip {shape} {splits} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            continue
        cells.append(Cell(shape, step, len(lens), sum(lens) / len(lens), splits, bn, warps, stages, bool(ordered), ms,
                          kv_bytes / (ms * 1e-3) / 1e12))  # fmt: skip
    return cells


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_sweep needs a CUDA GPU")
    from vllm_actors.kernels import triton_attention as ta

    device = torch.device("cuda:0")
    args.dtype = "bfloat16"
    snaps = workload_snapshots(args.num_requests, args.steps, args.seed)
    cells: list[Cell] = []
    defaults: dict[str, dict[int, float]] = {}
    spin_up()
    for shape in args.shapes:
        heads, kv_heads = (int(x) for x in shape.split("/"))
        args.num_heads, args.num_kv_heads = heads, kv_heads
        defaults[shape] = {}
        for step, lens in snaps.items():
            if not lens:
                continue
            default_splits = ta.choose_decode_splits(len(lens), kv_heads, 4096, device)
            cells += _sweep_snapshot(args, shape, step, lens, device)
            torch.cuda.empty_cache()
            here = [c for c in cells if c.shape == shape and c.step == step]
            best = min(here, key=lambda c: c.ms)
            key = (default_splits, 64, 4, 3, False)
            dflt = [c for c in here if (c.splits, c.block_n, c.num_warps, c.num_stages, c.ordered) == key]
            defaults[shape][step] = dflt[0].ms if dflt else float("nan")
            print(
                f"{shape} step {step:4d} batch {len(lens):3d} ctx {sum(lens) / len(lens):6.0f}: default "
                f"(splits {default_splits}, 64/4/3) {defaults[shape][step]:.4f} ms; best splits {best.splits} "
                f"{best.block_n}/{best.num_warps}/{best.num_stages}{' ordered' if best.ordered else ''} "
                f"{best.ms:.4f} ms {best.tbps:.2f} TB/s",
                flush=True,
            )
    # one config for all snapshots of a shape, with the split chosen per snapshot: which tile config
    # minimises the summed time when each snapshot takes its best split?
    for shape in args.shapes:
        mine = [c for c in cells if c.shape == shape]
        configs = sorted({(c.block_n, c.num_warps, c.num_stages, c.ordered) for c in mine})
        now = sum(defaults[shape].values())
        print(f"== {shape}: summed over steps, each step its best split (default now: {now:.3f} ms)")
        totals = []
        for cfg3 in configs:
            total, picks = 0.0, []
            for step in defaults[shape]:
                here = [c for c in mine if c.step == step and (c.block_n, c.num_warps, c.num_stages, c.ordered) == cfg3]
                if not here:
                    total = float("inf")
                    break
                b = min(here, key=lambda c: c.ms)
                total += b.ms
                picks.append(b.splits)
            totals.append((total, cfg3, picks))
        for total, cfg3, picks in sorted(totals)[:8]:
            print(f"  {cfg3}: {total:.3f} ms, splits per step {picks}")
        for splits, ordered in itertools.product(args.splits, args.orders):
            row = []
            for step in defaults[shape]:
                here = [c for c in mine if c.step == step and c.splits == splits and c.ordered == bool(ordered)]
                row.append(f"{min(c.ms for c in here):.3f}" if here else "-")
            print(f"  splits {splits:2d} ordered {ordered} (best tile per step): {' '.join(row)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"defaults": defaults, "cells": [asdict(c) for c in cells]}, indent=1))

