"""The speculative-decoding benchmark's queued phase (``spec_measure.queued``, ``spec_queued.measure_queued``)
over fake engines: N requests running with a queue behind them is one call of 4 x N requests to an engine
of ``max_num_seqs`` N; the modes alternate as in the paired rounds; per-round ratios against ``off``."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from benchmarks.lib import spec_measure, spec_queued


def test_the_queued_phase_asks_four_requests_a_slot_and_pairs_the_modes() -> None:
    calls: list[tuple[str, int, int]] = []

    def engine(name: str, speeds: list[float]) -> spec_measure.Generate:
        def generate(prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[int, float]:
            calls.append((name, len(prompts), max_tokens))
            tokens = len(prompts) * max_tokens
            return tokens, tokens / speeds.pop(0)
        return generate

    warm = [1000.0, 1000.0]  # the warm-up's two calls
    off = engine("off", [*warm, 100.0, 50.0, 100.0])
    ngram = engine("ngram", [*warm, 150.0, 60.0, 90.0])
    results = spec_queued.measure_queued({"off": off, "ngram": ngram}, [[1, 2, 3]] * 5, 8, 10, 3)
    queued = [c for c in calls if c[1] == spec_measure.QUEUED_PER_SLOT * 8]
    assert [name for name, _, _ in queued] == ["off", "ngram", "ngram", "off", "off", "ngram"]
    assert all(tokens == 10 for _, _, tokens in queued)
    assert results["off"]["queued_8_tok_s"] == pytest.approx(100.0)
    assert results["ngram"]["rounds"]["queued_8_tok_s"] == pytest.approx([150.0, 60.0, 90.0])
    ratio = results["ngram"]["ratio"]["queued_8_ratio"]
    assert ratio["rounds"] == pytest.approx([1.5, 1.2, 0.9])
    assert (ratio["median"], ratio["min"], ratio["max"]) == pytest.approx((1.2, 0.9, 1.5))
    assert "ratio" not in results["off"]
    with pytest.raises(ValueError, match="rounds"):
        spec_queued.measure_queued({"off": off}, [[1]], 8, 10, 0)
