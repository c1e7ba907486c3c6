"""``benchmarks/cost_replay.py``'s tail report: a step launched after the one before was read back (its wall
share its whole launch-to-read-back time) counts as serial, an overlapped or bunched one does not, and the
report says how many of the longest mixed steps were serial."""

from __future__ import annotations

import pytest
from benchmarks.cost_replay import Step, is_serial, tail_report


def step(wall_ms: float, execute_ms: float, chunk: bool = True) -> Step:
    return Step(prefill_tokens=256 if chunk else 0, decodes=100, chunks=[(500_000, 256)] if chunk else [],
                execute=execute_ms / 1e3, wall=wall_ms / 1e3, gpu=None, context=500_000 if chunk else -1)


def test_serial_steps_are_those_whose_wall_share_is_their_launch_to_read_back(capsys: pytest.CaptureFixture[str]) \
        -> None:
    assert is_serial(step(120, 120)) and is_serial(step(97, 100))
    assert not is_serial(step(60, 110))  # launched over the step before: overlapped
    steps = [step(60, 110)] * 98 + [step(120, 120)] * 2 + [step(5, 5, chunk=False)]
    tail_report(steps, [0.06] * len(steps))
    printed = capsys.readouterr().out
    assert "mixed steps 100" in printed
    assert "serial         2 steps, wall p50 120" in printed and "overlapped    98 steps, wall p50 60" in printed
    assert "top 2% by wall: 2 steps, 2 serial" in printed
