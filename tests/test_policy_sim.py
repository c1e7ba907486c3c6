"""Issue 18's claim on the scheduler alone (``bench/policy_sim.py``: the real Scheduler on a virtual
clock, H100 step costs, the mixed workload): at a rate where FCFS meets fewer than 80% of the
interactive deadlines, EDF and LRS meet at least 95% while batch throughput stays within 10% of
FCFS's. Deterministic: a fixed seed, a fixed cost model, no clock."""

from __future__ import annotations

import pytest

from vllm_actors.bench.policy_sim import SimConfig, SimResult, simulate
from vllm_actors.bench.serve_mixed import BATCH, INTERACTIVE, MixedWorkload

WORKLOAD = MixedWorkload(rate=96.0, duration=20.0, seed=0)


def figures(result: SimResult) -> tuple[float, float, float]:
    classes = result.attainment["classes"]
    return (classes[INTERACTIVE.name]["attainment"], classes[BATCH.name]["attainment"],
            classes[BATCH.name]["output_tok_s"])


@pytest.fixture(scope="module")
def fcfs() -> tuple[float, float, float]:
    return figures(simulate(WORKLOAD, SimConfig(policy="fcfs")))


def test_fcfs_misses_the_interactive_deadlines_at_this_rate(fcfs: tuple[float, float, float]) -> None:
    assert fcfs[0] < 0.80


@pytest.mark.parametrize("policy", ["edf", "lrs"])
def test_deadline_policies_meet_them_and_keep_batch_throughput(policy: str, fcfs: tuple[float, float, float]) -> None:
    result = simulate(WORKLOAD, SimConfig(policy=policy))
    interactive, batch, batch_tok_s = figures(result)
    assert interactive >= 0.95
    assert batch >= fcfs[1] - 0.01
    assert batch_tok_s >= 0.9 * fcfs[2]
    assert result.preemptions > 0  # slots taken from batch requests: the mechanism, not luck
