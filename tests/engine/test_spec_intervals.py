"""The wall time a step reports (``StepResult.interval_seconds``, what the n-gram drafting policy
prices steps in): a step launched with nothing in flight (a drafting step, read back at once, or
the plain step after it) counts from the last read-back, so the host work between a read-back and
the next launch, which the device idles through, is charged to it; a step launched while another
is in flight does not (that work is overlapped). On a fake clock only the runner and the test move."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_deferred_steps import DeferringFakeRunner, _new
from vllm_actors.actors.worker.ngram_drafts import NgramProposer
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.messages import StepPlan, StepResult
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import WORKER_DRAFT
from vllm_actors.runner.sampler import Sampler

STEP = 1e-3  # the device's seconds a step (the fake clock's)
GAP = 2.5e-4  # the host's seconds between a read-back and the next plan's launch


class Clocked(DeferringFakeRunner):
    """Repeats its context with period 3 (every n-gram draft right); a step advances ``now``."""

    now = 0.0

    def next_token(self, context: list[int]) -> int:
        return context[-3]

    def execute(self, batch):  # type: ignore[no-untyped-def]
        self.now += STEP
        return super().execute(batch)


def results(outputs: object) -> list[StepResult]:
    return [r for r in outputs.to(SCHEDULER) if isinstance(r, StepResult)]  # type: ignore[attr-defined]


def test_drained_steps_count_the_host_gap_before_their_launch() -> None:
    runner = Clocked(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: runner.now, defer=True,
                    drafter=NgramProposer(min_n=1, max_n=3))
    worker.pending_ready = lambda: worker._pending is None  # type: ignore[method-assign]  # a busy device
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    prompt = [1, 2, 3, 1, 2, 3, 1]
    worker.handle(StepPlan(step_id=0, new_requests=[_new("a", prompt, greedy)], req_ids=["a"], num_tokens=[7],
                           num_blocks=[2], new_block_ids=[[0, 1]]))
    runner.now += GAP
    drafting = [StepPlan(step_id=step, req_ids=["a"], num_tokens=[3], num_blocks=[2 + step],
                         new_block_ids=[[1 + step]], draft_token_ids={"a": [WORKER_DRAFT] * 2}) for step in (1, 2)]
    first = results(worker.handle(drafting[0]))  # step 0 read back, then step 1 launched and read back at once
    assert [r.step_id for r in first] == [0, 1] and first[1].interval_seconds == pytest.approx(STEP)
    runner.now += GAP  # its result sent, the next plan received and checked: the device idles
    second = results(worker.handle(drafting[1]))
    assert [r.step_id for r in second] == [2] and len(second[0].req_ids) == 3  # both drafts kept
    assert second[0].interval_seconds == pytest.approx(GAP + STEP)
    runner.now += GAP
    plain = [StepPlan(step_id=step, req_ids=["a"], num_tokens=[1], num_blocks=[5], new_block_ids=[blocks])
             for step, blocks in ((3, [4]), (4, []))]
    assert not results(worker.handle(plain[0]))  # deferred, launched with nothing in flight
    runner.now += GAP
    overlapped = results(worker.handle(plain[1]))  # launched behind step 3, which is then read back
    # from step 2's read-back (the fake clock moves at launches: step 4's run is in it, not in step 4's)
    assert [r.step_id for r in overlapped] == [3] and overlapped[0].interval_seconds == pytest.approx(2 * (GAP + STEP))
    later = results(worker.flush())
    assert [r.step_id for r in later] == [4] and later[0].interval_seconds == 0.0  # launched before step 3's read-back
    runner.now += 1.0  # an idle engine: a gap this long is not the next step's
    idle = StepPlan(step_id=5, req_ids=["a"], num_tokens=[3], num_blocks=[5], new_block_ids=[[]],
                    draft_token_ids={"a": [WORKER_DRAFT] * 2})
    assert results(worker.handle(idle))[0].interval_seconds == pytest.approx(STEP)
