"""The decode sweep's batches (`benchmarks/lib/decode_sweep.py`; the timing itself needs a GPU)."""

from __future__ import annotations

import random
import sys
from pathlib import Path

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib.decode_sweep import parse_args, workload_snapshots


def test_snapshots_are_the_sequences_still_decoding_with_their_contexts() -> None:
    steps = [0, 50, 500, 1023, 1024]
    snaps = workload_snapshots(256, steps, seed=0)
    rng = random.Random(0)
    reqs = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(256)]
    assert snaps[0] == [p for p, _ in reqs]  # every request decodes at step 0, its context the prompt
    assert snaps[500] == [p + 500 for p, o in reqs if o > 500]
    sizes = [len(snaps[t]) for t in steps]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 256 and sizes[-1] == 0  # the batch shrinks to nothing
    assert all(100 + 50 <= c <= 1024 + 50 for c in snaps[50])


def test_the_default_grid_covers_the_old_and_new_decode_defaults() -> None:
    args = parse_args([])
    assert {64, 128} <= set(args.block_n) and 4 in args.warps and 3 in args.stages
    assert set(args.orders) == {0, 1} and 1 in args.splits
