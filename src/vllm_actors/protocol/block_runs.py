"""Block copies as runs: ``[src, dst, count, src, dst, count, ...]``, flat, so a copy of 62,500
blocks (a 1M-token prompt) whose ids are consecutive travels as three integers, not as two lists
of 62,500. Used by the step plan's copies between the GPU pool and the host tier, and their
BLOCK_OFFLOADED / BLOCK_RESTORED events."""

from __future__ import annotations

from collections.abc import Iterator, Sequence


def to_runs(src: Sequence[int], dst: Sequence[int]) -> list[int]:
    """Pairs ``src[i] -> dst[i]`` as runs, in source order (the copies of one batch are
    independent): pairs whose ids both go up by one merge."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destinations")
    runs: list[int] = []
    for s, d in sorted(zip(src, dst, strict=True)):
        if runs and runs[-3] + runs[-1] == s and runs[-2] + runs[-1] == d:
            runs[-1] += 1
        else:
            runs += (s, d, 1)
    return runs


def iter_runs(runs: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(src, dst, count) of each run."""
    if len(runs) % 3:
        raise ValueError(f"block runs come in threes (src, dst, count), got {len(runs)} integers")
    for index in range(0, len(runs), 3):
        yield runs[index], runs[index + 1], runs[index + 2]


def num_blocks(runs: Sequence[int]) -> int:
    return sum(runs[2::3])
