"""The supervisor's restart policy (``runtime/supervision.py``) in process with a fake clock: the
restart budget per window, liveness verdicts (no ping, or busy too long on one message), how an
exit is told."""

from __future__ import annotations

import pytest

from vllm_actors.runtime.supervision import Liveness, RestartBudget, exit_detail


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_allows_max_restarts_per_window() -> None:
    clock = FakeClock()
    budget = RestartBudget(2, 10.0, clock)
    assert budget.try_spend()
    clock.now += 1.0
    assert budget.try_spend()
    assert not budget.try_spend() and budget.used() == 2  # a refusal records nothing
    clock.now += 8.9
    assert not budget.try_spend()
    clock.now += 0.1  # the first restart leaves the window
    assert budget.used() == 1 and budget.try_spend() and not budget.try_spend()
    clock.now += 100
    assert budget.used() == 0
    assert not RestartBudget(0, 60.0, clock).try_spend()
    with pytest.raises(ValueError):
        RestartBudget(-1, 60.0, clock)


def test_liveness_verdicts() -> None:
    clock = FakeClock()
    liveness = Liveness(timeout=5.0, max_busy=300.0, clock=clock)
    assert liveness.verdict("worker-0") is None  # not watched
    liveness.started("worker-0")
    clock.now += 4.9
    assert liveness.verdict("worker-0") is None
    clock.now += 0.1
    assert "no liveness ping for 5.0 s" in (liveness.verdict("worker-0") or "")
    liveness.ping("worker-0", busy=0.0)
    assert liveness.verdict("worker-0") is None
    liveness.ping("worker-0", busy=300.0)  # a long step is allowed up to the limit
    assert liveness.verdict("worker-0") is None
    liveness.ping("worker-0", busy=300.5)
    assert "busy on one message for 300.5 s" in (liveness.verdict("worker-0") or "")
    liveness.ping("worker-0", busy=0.0)
    assert liveness.verdict("worker-0") is None
    liveness.forget("worker-0")
    clock.now += 60
    assert liveness.verdict("worker-0") is None


def test_exit_details() -> None:
    assert exit_detail(-9) == "killed by SIGKILL"
    assert exit_detail(1) == "exit code 1"
    assert exit_detail(0) == "exit code 0"

