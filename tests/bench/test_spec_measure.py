"""The speculative-decoding benchmark's timing loop (``benchmarks/lib/spec_measure.py``) with a fake
engine: the same warm-up whatever the mode, and each phase's drafting from the engine's counters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from benchmarks.lib import spec_measure


def test_each_phase_records_what_the_policy_drafted() -> None:
    calls: list[tuple[int, int]] = []
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}

    def generate(prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[int, float]:
        calls.append((len(prompts), max_tokens))
        if len(prompts) == 1 and max_tokens == 10:  # batch 1 drafts 4 per step, 2 accepted: 10 tokens in 3.33 steps
            totals["num_drafts"] += 3
            totals["num_draft_tokens"] += 12
            totals["num_accepted_tokens"] += 6
        return len(prompts) * max_tokens, 0.01

    def counters() -> dict[str, Any]:
        return dict(totals)

    result = spec_measure.measure(generate, [[1, 2, 3]] * 16, 10, 2, [16], counters=counters)
    warmup = [(1, spec_measure.WARMUP_TOKENS), (spec_measure.WARMUP_BATCH, spec_measure.WARMUP_TOKENS // 2)]
    assert calls == [*warmup, (1, 10), (1, 10), (16, 10)]
    batch1 = result["phase_drafting"]["batch1"]
    assert batch1["num_drafts"] == 6 and batch1["mean_k"] == 4.0
    assert batch1["drafting_share"] == 6 / (20 - 12)  # request-steps: tokens less accepted drafts
    assert result["phase_drafting"]["concurrency_16"] == {"num_drafts": 0, "num_draft_tokens": 0,
                                                          "num_accepted_tokens": 0, "mean_k": 0.0,
                                                          "drafting_share": 0.0, "tokens": 160}
    assert "phase_drafting" not in spec_measure.measure(generate, [[1]] * 16, 10, 1, [])
