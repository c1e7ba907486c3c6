"""The worker's use of the step timer (``gpu_timing``): which steps it times, and what it reports of them.

A step is timed on the GPU where its read-back will not wait for the device: it samples nothing (a
prefill chunk short of its prompt's end; a stage before the last), or any step of a pipeline's last
stage (whose read-back waits for the stages before it as well). Once complete, each is published as
``STEP_TIMED`` and, by the rank that answers the scheduler, kept for the next ``StepResult``'s
``gpu_timings``. Only rank 0 of a stage times anything: the others get a disabled timer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_actors.actors.worker.gpu_timing import MAX_OUTSTANDING, StepTimer
from vllm_actors.protocol.events import StepTimed
from vllm_actors.protocol.messages import StepGpuTime, StepResult
from vllm_actors.protocol.outputs import Outputs

if TYPE_CHECKING:  # ranks imports torch; this module does not
    from vllm_actors.actors.worker.ranks import Stage


class TimingReports:
    def __init__(self, timer: StepTimer | None, stage: Stage, answers: bool) -> None:
        """``timer``: None on a rank that reports nothing (every call then a no-op). ``answers``:
        this rank sends the scheduler its results (the last stage's rank 0)."""
        self.timer = timer if timer is not None else StepTimer()
        self.stage = stage
        self.answers = answers
        self._unsent: list[StepGpuTime] = []  # the last stage's, for the next result
        self._open = False  # the step being launched is timed

    # ------------------------------------------------------------------ around a step's launch
    def begin(self, step_id: int, samples: bool) -> bool:
        """Before the step's GPU work: whether it is timed (its result then says ``execute_seconds`` 0)."""
        self._open = self.timer.enabled and (not samples or not self.stage.is_last or self.stage.enabled)
        if self._open:
            self.timer.begin(step_id)
        return self._open

    def end(self) -> None:
        """After the step's GPU work is queued (nothing when ``begin`` did not time it)."""
        if self._open:
            self.timer.end()
        self._open = False

    # ------------------------------------------------------------------ polling and reports
    def outstanding(self) -> bool:
        """Timed steps not complete when last looked."""
        return self.timer.num_outstanding > 0

    def ready(self) -> bool:
        """Nothing outstanding, or the oldest outstanding step is complete."""
        return self.timer.num_outstanding == 0 or self.timer.any_done()

    def report(self, outputs: Outputs, result: StepResult | None = None) -> None:
        """The timed steps complete now, published; on the answering rank, kept for the next result,
        and ``result`` (one going to the scheduler) takes every one kept so far."""
        if self.timer.enabled:
            stage = None if self.stage.is_last else self.stage.stage
            for timing in self.timer.completed():
                outputs.emit(StepTimed(step_id=timing.step_id, stage=stage, gpu_ms=timing.seconds * 1e3,
                                       gpu_start=timing.start, gpu_end=timing.end))
                if self.answers:
                    self._unsent.append(timing)
            del self._unsent[:-MAX_OUTSTANDING]  # bounded, should no result go out for long
        if result is not None and self.answers:
            result.gpu_timings, self._unsent = self._unsent, []
