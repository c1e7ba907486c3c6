"""The speculative-decoding benchmark's paired rounds (``benchmarks/lib/spec_paired.py``) over fake
engines: the same warm-up per mode, each phase on every mode back to back (order reversed every other
round), medians over rounds in ``spec_measure``'s keys, per-round ratios against ``off``, drafting
summed over rounds; and the engines' memory shares (``spec_ours.engine_shares``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from benchmarks.lib import spec_measure, spec_ours, spec_paired

WARMUP = [(1, spec_measure.WARMUP_TOKENS), (spec_measure.WARMUP_BATCH, spec_measure.WARMUP_TOKENS // 2)]


class FakeEngine:
    """Generates every token asked for; the seconds a call takes come from ``speeds`` (tok/s per call,
    in turn: the load of the moment); an n-gram engine drafts 2 a request-step at batch 1."""

    def __init__(self, name: str, log: list[tuple[str, int, int]], speeds: list[float], drafts: bool) -> None:
        self.name, self.log, self.speeds, self.drafts = name, log, speeds, drafts
        self.totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[int, float]:
        self.log.append((self.name, len(prompts), max_tokens))
        tokens = len(prompts) * max_tokens
        if self.drafts and len(prompts) == 1:
            self.totals["num_drafts"] += 4
            self.totals["num_draft_tokens"] += 8
            self.totals["num_accepted_tokens"] += 4
        return tokens, tokens / self.speeds.pop(0)

    def counters(self) -> dict[str, Any]:
        return dict(self.totals)


def test_rounds_alternate_the_modes_and_pair_each_phase() -> None:
    log: list[tuple[str, int, int]] = []
    # per call: 2 warm-ups, then per round batch 1 (2 requests) and concurrency 16; round 2 runs ngram first
    # and falls on a slow moment for both (the neighbour's load): the ratio stays
    off = FakeEngine("off", log, [100, 100, 100, 100, 1000, 50, 50, 500, 100, 100, 1000], drafts=False)
    ngram = FakeEngine("ngram", log, [100, 100, 200, 200, 990, 100, 100, 490, 200, 200, 1010], drafts=True)
    results = spec_paired.measure_paired({"off": off.generate, "ngram": ngram.generate}, [[1, 2]] * 16, 10, 2,
                                         [16], 3, {"off": off.counters, "ngram": ngram.counters})
    b1, c16 = [("off", 1, 10)] * 2, [("off", 16, 10)]
    n1, n16 = [("ngram", 1, 10)] * 2, [("ngram", 16, 10)]
    assert log == ([("off", *w) for w in WARMUP] + [("ngram", *w) for w in WARMUP]
                   + b1 + n1 + c16 + n16 + n1 + b1 + n16 + c16 + b1 + n1 + c16 + n16)
    assert results["off"]["batch1_ms_per_token"] == 10.0 and results["ngram"]["batch1_ms_per_token"] == 5.0
    assert results["off"]["rounds"]["batch1_ms_per_token"] == [10.0, 20.0, 10.0]
    assert results["off"]["rounds"]["concurrency_16_tok_s"] == pytest.approx([1000, 500, 1000])
    assert results["ngram"]["concurrency_16_tok_s"] == pytest.approx(990)  # the median over rounds
    paired = results["ngram"]["paired_vs_off"]
    assert paired["batch1_speedup"]["rounds"] == pytest.approx([2.0, 2.0, 2.0])
    assert paired["concurrency_16_ratio"]["rounds"] == pytest.approx([0.99, 0.98, 1.01])
    assert (paired["concurrency_16_ratio"]["min"], paired["concurrency_16_ratio"]["max"]) == pytest.approx((0.98, 1.01))
    assert paired["concurrency_16_ratio"]["median"] == pytest.approx(0.99)
    assert "paired_vs_off" not in results["off"]
    drafting = results["ngram"]["phase_drafting"]["batch1"]  # 3 rounds x 2 requests, each 4 drafting steps
    assert drafting["num_drafts"] == 24 and drafting["mean_k"] == 2.0
    assert drafting["drafting_share"] == 24 / (60 - 24)
    assert results["ngram"]["phase_drafting"]["concurrency_16"]["num_drafts"] == 0
    line = spec_paired.paired_line("ngram", "off", paired)
    assert line == ("ours ngram / off, paired over 3 rounds: batch1_speedup x2.000 [2.000, 2.000], "
                    "c16 x0.990 [0.980, 1.010]")


def test_one_mode_and_bad_rounds() -> None:
    log: list[tuple[str, int, int]] = []
    off = FakeEngine("off", log, [100.0] * 5, drafts=False)
    result = spec_paired.measure_paired({"off": off.generate}, [[1]], 10, 1, [4], 1)["off"]
    assert set(result) == {"batch1_ms_per_token", "batch1_samples", "concurrency_4_tok_s", "rounds"}
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        spec_paired.measure_paired({"off": off.generate}, [[1]], 10, 1, [4], 0)


def test_batch_repeats_run_each_closed_batch_in_a_row_and_pool_their_tokens() -> None:
    log: list[tuple[str, int, int]] = []
    # warm-ups, batch 1, then the closed batch of 4 three times: 400, 100, 400 tok/s
    off = FakeEngine("off", log, [100.0] * 3 + [400.0, 100.0, 400.0], drafts=False)
    result = spec_paired.measure_paired({"off": off.generate}, [[1]], 10, 1, [4], 1, batch_repeats=3)["off"]
    assert log[-3:] == [("off", 4, 10)] * 3
    assert result["concurrency_4_tok_s"] == pytest.approx(120 / (40 / 400 + 40 / 100 + 40 / 400))  # pooled, 200
    assert spec_measure.concurrent(FakeEngine("x", [], [50.0, 150.0], False).generate, [[1]], 2, 5, 2) == \
        (pytest.approx(20 / (10 / 50 + 10 / 150)), 20)


def test_engine_shares_leave_each_engine_an_equal_part() -> None:
    assert spec_ours.engine_shares(0.9, 3) == pytest.approx([0.3, 0.6, 0.9])
    assert spec_ours.engine_shares(0.8, 1) == [0.8]
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        spec_ours.engine_shares(1.5, 2)
