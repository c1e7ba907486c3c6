"""A worker's steps that sample nothing, timed on the GPU (a fake timer over fake CUDA events, the
fake runner's forward queueing stream time): their result says execute_seconds 0, and once their
end event completes they are published (STEP_TIMED, with the stage) and, on the last stage, sent
in the next result's gpu_timings; the shell's flush reports them between steps. On the CPU nothing
changes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.support.fake_gpu_events import FakeGpu
from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.worker.ranks import OnlyStage
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.events import StepFinished, StepTimed
from vllm_actors.protocol.messages import NewRequest, StepGpuTime, StepPlan, StepResult
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids
from vllm_actors.runner.gpu_events import step_timer
from vllm_actors.runner.sampler import Sampler

PROMPT = list(range(1, 9))  # 8 tokens: two chunks of 4
MS_PER_TOKEN = 2.0


@dataclass
class _StreamRunner(FakeRunner):
    """The fake runner whose forward pass queues 2 ms of stream time per token."""

    gpu: FakeGpu | None = None

    def execute(self, batch: BatchInput) -> torch.Tensor:
        assert self.gpu is not None
        self.gpu.run(MS_PER_TOKEN * len(batch.token_ids))
        return super().execute(batch)


def _plans() -> list[StepPlan]:
    new = NewRequest(request_id="a", token_ids=pack_token_ids(PROMPT), num_prompt_tokens=8, num_output_tokens=0,
                     params=SamplingParams(temperature=0.0, max_tokens=4), eos_token_ids=[])
    return [StepPlan(step_id=0, new_requests=[new], req_ids=["a"], num_tokens=[4], num_blocks=[1],
                     new_block_ids=[[0]]),
            StepPlan(step_id=1, req_ids=["a"], num_tokens=[4], num_blocks=[2], new_block_ids=[[1]])]


def _worker(stage: OnlyStage, timed: bool = True) -> tuple[Worker, FakeGpu]:
    gpu = FakeGpu(wall=500.0)
    runner = _StreamRunner(num_blocks=8, block_size=4, gpu=gpu)
    ticks = iter(range(1, 1_000))
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.001 * next(ticks), stage=stage,
                    timer=gpu.timer() if timed else step_timer(runner.device))
    return worker, gpu


def test_the_last_stage_sends_a_chunks_gpu_time_with_a_later_result() -> None:
    worker, gpu = _worker(OnlyStage())
    first_plan, last_plan = _plans()
    outputs = worker.handle(first_plan)
    (first,) = outputs.to(SCHEDULER)
    assert isinstance(first, StepResult) and first.req_ids == [] and first.execute_seconds == 0.0
    assert first.gpu_timings == [] and not any(isinstance(e, StepTimed) for e in outputs.events)
    (finished,) = [event for event in outputs.events if isinstance(event, StepFinished)]
    assert finished.execute_ms == pytest.approx(1.0)  # the host's launch time, as before
    assert worker.has_pending() and not worker.pending_ready()  # the chunk still runs on the GPU

    gpu.reach(gpu.clock)  # done with both chunks by the time the last one is read back
    outputs = worker.handle(last_plan)
    (last,) = outputs.to(SCHEDULER)
    assert isinstance(last, StepResult) and last.req_ids == ["a"]
    assert last.execute_seconds == pytest.approx(0.001)  # a sampled step: timed as before
    (timing,) = last.gpu_timings
    assert isinstance(timing, StepGpuTime)
    assert (timing.step_id, timing.seconds, timing.start, timing.end) == (
        0, pytest.approx(0.008), pytest.approx(500.0), pytest.approx(500.008))
    (timed,) = [event for event in outputs.events if isinstance(event, StepTimed)]
    assert (timed.step_id, timed.stage, timed.gpu_ms) == (0, None, pytest.approx(8.0))
    assert not worker.has_pending() and worker.flush().events == []


def test_an_earlier_stage_times_every_step_and_the_flush_publishes_it() -> None:
    worker, gpu = _worker(OnlyStage(stage=0, is_last=False))
    first_plan, last_plan = _plans()
    assert worker.handle(first_plan).to(SCHEDULER) == []
    outputs = worker.handle(last_plan)  # it completes its prompt, but this stage samples nothing
    assert outputs.to(SCHEDULER) == [] and not any(isinstance(e, StepTimed) for e in outputs.events)
    assert worker.timer.num_outstanding == 2
    assert worker.has_pending() and not worker.pending_ready()
    gpu.reach(8.0)  # the first chunk done, the second running: the shell flushes what is done
    assert worker.pending_ready()
    flushed = worker.flush()
    assert flushed.messages == [] and [(e.step_id, e.stage, e.gpu_ms) for e in flushed.events] == [
        (0, 0, pytest.approx(8.0))]
    assert worker.has_pending() and not worker.pending_ready()
    gpu.reach(16.0)
    (second,) = worker.flush().events
    assert isinstance(second, StepTimed) and (second.step_id, second.stage) == (1, 0)
    assert (second.gpu_start, second.gpu_end) == (pytest.approx(500.008), pytest.approx(500.016))
    assert not worker.has_pending()


def test_timings_found_by_a_flush_go_out_with_the_next_result() -> None:
    worker, gpu = _worker(OnlyStage())
    first_plan, last_plan = _plans()
    worker.handle(first_plan)
    gpu.reach(gpu.clock)
    flushed = worker.flush()  # between steps: published now, for the scheduler with the next result
    assert [type(event) for event in flushed.events] == [StepTimed] and flushed.messages == []
    (last,) = worker.handle(last_plan).to(SCHEDULER)
    assert [timing.step_id for timing in last.gpu_timings] == [0]


def test_on_the_cpu_nothing_is_timed_on_the_side() -> None:
    worker, _ = _worker(OnlyStage(), timed=False)
    assert not worker.timer.enabled  # no timer given: none (build_worker gives one on CUDA alone)
    first_plan, last_plan = _plans()
    outputs = worker.handle(first_plan)
    (first,) = outputs.to(SCHEDULER)
    assert first.execute_seconds == pytest.approx(0.001) and first.gpu_timings == []
    assert not worker.has_pending() and worker.pending_ready()
    outputs = worker.handle(last_plan)
    assert not any(isinstance(event, StepTimed) for event in outputs.events)
    assert outputs.to(SCHEDULER)[0].gpu_timings == []


def test_a_pipelines_last_stage_times_its_sampled_steps_too() -> None:
    # its read-back waits for the stages before it: the host's time would count theirs
    worker, gpu = _worker(OnlyStage(stage=1, is_last=True, enabled=True))
    first_plan, last_plan = _plans()
    worker.handle(first_plan)
    gpu.reach(gpu.clock)
    outputs = worker.handle(last_plan)
    (last,) = outputs.to(SCHEDULER)
    assert last.req_ids == ["a"] and last.execute_seconds == 0.0  # sampled, and its time comes later
    gpu.reach(gpu.clock)
    (timed,) = worker.flush().events
    assert isinstance(timed, StepTimed) and (timed.step_id, timed.stage, timed.gpu_ms) == (1, None, pytest.approx(8.0))


def test_the_last_stage_never_takes_a_plans_input_token() -> None:
    # A TP rank of the last stage other than the one that answers may read its deferred step back
    # after the next plan is here: the plan's input token must not be appended too (it was, and the
    # rank's state drifted from its peer's until a collective hung: PP=2 x TP=2 over gloo).
    worker, _ = _worker(OnlyStage(stage=1, is_last=True, enabled=True), timed=False)
    for plan in _plans():
        worker.handle(plan)
    request = worker.requests["a"]
    del request.token_ids[request.num_computed_tokens:]  # its sampled token still pending
    worker._take_input_tokens(StepPlan(step_id=2, req_ids=["a"], num_tokens=[1], num_blocks=[3],
                                       input_token_ids={"a": 99}))
    assert len(request.token_ids) == request.num_computed_tokens
    earlier, _ = _worker(OnlyStage(stage=0, is_last=False, enabled=True), timed=False)
    for plan in _plans():
        earlier.handle(plan)
    before = len(earlier.requests["a"].token_ids)
    earlier._take_input_tokens(StepPlan(step_id=2, req_ids=["a"], num_tokens=[1], num_blocks=[3],
                                        input_token_ids={"a": 99}))
    assert earlier.requests["a"].token_ids[before:] == [99]  # a stage before the last takes it
