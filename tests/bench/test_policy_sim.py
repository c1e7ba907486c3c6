"""The scheduling policies' claim on the scheduler alone (``bench/policy_sim.py``: the real Scheduler on a virtual
clock, H100 step costs, the mixed workload): at a rate where FCFS meets fewer than 80% of the
interactive deadlines, EDF and LRS meet at least 95% while batch throughput stays within 10% of
FCFS's. Deterministic: a fixed seed, a fixed cost model, no clock."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from vllm_actors.actors.scheduler.cost_model import FixedCostModel
from vllm_actors.bench.policy_sim import SimConfig, SimResult, fit_costs, simulate
from vllm_actors.bench.serve_mixed import BATCH, INTERACTIVE, MixedWorkload
from vllm_actors.observe.trace import chrome_trace
from vllm_actors.protocol.events import StepFinished, StepStarted

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


def test_the_cost_model_is_fitted_from_a_traces_worker_steps(tmp_path: Path) -> None:
    """Steps of known cost through the real trace builder (``chrome_trace``), gzipped as ``bench
    serve --trace`` keeps them: the fit gives the coefficients back."""
    truth = FixedCostModel(a=0.006, b=5e-6, c=3e-5)
    rows = []
    for step_id, (prefill_seqs, prefill_tokens, decodes) in enumerate(
            [(0, 0, 10), (1, 500, 40), (2, 3000, 100), (0, 0, 250), (1, 8000, 5), (3, 1200, 180)]):
        execute_ms = truth.step_seconds(prefill_tokens, decodes) * 1e3
        wall = 1.0 + 0.1 * step_id
        rows.append(("worker-0", 2 * step_id, wall, 100.0 + wall,
                     StepStarted(step_id=step_id, num_seqs=prefill_seqs + decodes,
                                 num_tokens=prefill_tokens + decodes, num_prefill_seqs=prefill_seqs)))
        rows.append(("worker-0", 2 * step_id + 1, wall, 100.0 + wall,
                     StepFinished(step_id=step_id, num_seqs=prefill_seqs + decodes, num_tokens=prefill_tokens + decodes,
                                  num_sampled=prefill_seqs + decodes, execute_ms=execute_ms)))
    path = tmp_path / "trace.json.gz"
    path.write_bytes(gzip.compress(json.dumps(chrome_trace(rows)).encode()))
    fitted, num_steps = fit_costs(path)
    assert num_steps == 6
    assert fitted.a == pytest.approx(truth.a, rel=1e-6)
    assert fitted.b == pytest.approx(truth.b, rel=1e-6)
    assert fitted.c == pytest.approx(truth.c, rel=1e-6)
    (tmp_path / "empty.json").write_text(json.dumps(chrome_trace(rows[:2])))
    with pytest.raises(ValueError, match="at least 3"):
        fit_costs(tmp_path / "empty.json")
