"""The GPU step timer (actors/worker/gpu_timing.py) over fake CUDA events: steps come back in launch
order once their end event completes, never waited for; their wall times from the origin taken at
construction; a later stage's wait for its input and an earlier one's for its last send left out;
bounded; disabled off CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.support.fake_gpu_events import FakeGpu
from vllm_actors.actors.worker.gpu_timing import MAX_FREE_EVENTS, REANCHOR_S, StepTimer
from vllm_actors.runner.gpu_events import step_timer


def _step(gpu: FakeGpu, timer: StepTimer, step_id: int, ms: float, idle_before: float = 0.0) -> None:
    gpu.run(idle_before)  # the stream reaches the step's start this much later
    timer.begin(step_id)
    gpu.run(ms)
    timer.end()


def test_steps_come_back_in_launch_order_once_complete_with_their_wall_times() -> None:
    gpu = FakeGpu(clock=5.0, wall=1_000.0)
    timer = gpu.timer()
    assert timer.enabled and gpu.synchronized == [5.0, 5.0]  # the origin: at stream time 5 ms, wall 1000 s
    _step(gpu, timer, 10, 20.0)  # 5..25 ms
    _step(gpu, timer, 11, 30.0, idle_before=5.0)  # 30..60 ms
    assert timer.num_outstanding == 2 and not timer.any_done() and timer.completed() == []
    gpu.reach(40.0)  # the first done, the second running
    assert timer.any_done()
    (first,) = timer.completed()
    assert first.step_id == 10 and first.seconds == pytest.approx(0.020)
    assert (first.start, first.end) == (pytest.approx(1_000.0), pytest.approx(1_000.020))
    assert timer.num_outstanding == 1 and timer.completed() == []
    gpu.reach(60.0)
    (second,) = timer.completed()
    assert (second.step_id, second.seconds) == (11, pytest.approx(0.030))
    assert second.start == pytest.approx(1_000.025) and second.end == pytest.approx(1_000.055)
    assert timer.num_outstanding == 0 and not timer.any_done()
    assert gpu.synchronized == [5.0, 5.0]  # never synchronised after construction


def test_a_later_step_done_first_waits_for_the_earlier_one() -> None:
    """One stream completes in order; the look stops at the first step not complete (nothing after it queried)."""
    gpu = FakeGpu()
    timer = gpu.timer()
    _step(gpu, timer, 1, 10.0)
    _step(gpu, timer, 2, 10.0)
    first_end = timer._outstanding[0].end  # an event of another stream could complete out of order
    assert first_end is not None
    first_end.at = 100.0
    gpu.reach(50.0)
    queries = gpu.num_queries
    assert timer.completed() == [] and gpu.num_queries == queries + 1
    gpu.reach(100.0)
    assert [timing.step_id for timing in timer.completed()] == [1, 2]


def test_the_waits_for_input_and_for_the_last_send_are_left_out() -> None:
    gpu = FakeGpu()
    timer = gpu.timer()
    timer.begin(3)
    gpu.run(7.0)  # the stream waits for the previous stage's activations
    timer.work_started()
    gpu.run(12.0)  # the stage's layers
    timer.work_done()
    gpu.run(4.0)  # waits for its previous send before sending this one
    timer.work_started()  # a second receive cannot move a step already done
    timer.end()
    gpu.reach(gpu.clock)
    (timing,) = timer.completed()
    assert timing.seconds == pytest.approx(0.012) and timing.start == pytest.approx(1_000.007)
    timer.work_started()  # no step open: nothing happens
    timer.work_done()
    timer.end()
    assert timer.num_outstanding == 0


def test_outstanding_steps_are_bounded_and_events_reused() -> None:
    gpu = FakeGpu()
    timer = gpu.timer(max_outstanding=3)
    for step_id in range(5):
        _step(gpu, timer, step_id, 1.0)
    assert timer.num_outstanding == 3 and timer.num_dropped == 2
    gpu.reach(gpu.clock)
    assert [timing.step_id for timing in timer.completed()] == [2, 3, 4]
    made = gpu.num_events
    for step_id in range(5, 8):
        _step(gpu, timer, step_id, 1.0)
    assert gpu.num_events == made  # the completed steps' events recorded again
    assert len(timer._free) <= MAX_FREE_EVENTS


def test_the_origin_moves_on_to_a_completed_step_and_times_stay_on_the_wall_clock() -> None:
    gpu = FakeGpu()
    timer = gpu.timer()
    _step(gpu, timer, 1, 10.0, idle_before=REANCHOR_S * 1e3)  # a minute later
    _step(gpu, timer, 2, 10.0, idle_before=5.0)
    gpu.reach(gpu.clock)
    first, second = timer.completed()
    assert first.start == pytest.approx(1_000.0 + REANCHOR_S)
    assert second.start == pytest.approx(first.end + 0.005) and second.seconds == pytest.approx(0.010)
    assert timer._origin is not None and timer._origin.at == pytest.approx(REANCHOR_S * 1e3 + 10.0)  # step 1 end


def test_off_cuda_the_timer_does_nothing() -> None:
    timer = step_timer(torch.device("cpu"))
    assert not timer.enabled and not step_timer(None).enabled and not StepTimer().enabled
    timer.begin(1)
    timer.work_started()
    timer.work_done()
    timer.end()
    assert timer.num_outstanding == 0 and not timer.any_done() and timer.completed() == []
