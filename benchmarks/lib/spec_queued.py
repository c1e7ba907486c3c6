"""N requests decoding at once with more queued behind them (``spec_measure.queued``: engines started
with ``max_num_seqs`` N), for this engine's side of ``benchmarks/spec_decode.py``: each mode's engine
measured in paired rounds, as ``spec_paired`` does for the other phases."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.lib.spec_measure import Generate, queued, warm_up
from benchmarks.lib.spec_paired import spread


def measure_queued(generates: Mapping[str, Generate], prompts: Sequence[Sequence[int]], slots: int,
                   output_len: int, rounds: int, baseline: str = "off") -> dict[str, dict[str, Any]]:
    """Each mode's ``queued_<slots>_tok_s`` (the median over ``rounds``, the modes' order reversed every
    other round, as ``spec_paired``), its rounds, and against ``baseline`` the per-round ratio
    (``queued_<slots>_ratio``: median, min, max, rounds)."""
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    modes = list(generates)
    for mode in modes:
        warm_up(generates[mode], prompts)
    values: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_index in range(rounds):
        for mode in modes if round_index % 2 == 0 else modes[::-1]:
            values[mode].append(queued(generates[mode], prompts, slots, output_len)[0])
    key = f"queued_{slots}"
    results: dict[str, dict[str, Any]] = {
        mode: {f"{key}_tok_s": statistics.median(found), "rounds": {f"{key}_tok_s": found}}
        for mode, found in values.items()}
    if baseline in values:
        for mode in modes:
            if mode != baseline:
                results[mode]["ratio"] = {f"{key}_ratio": spread(
                    [m / b for m, b in zip(values[mode], values[baseline], strict=True)])}
    return results
