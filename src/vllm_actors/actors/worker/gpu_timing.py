"""GPU time of the steps whose read-back does not wait for the device, by CUDA events, never synchronising.

A step that samples nothing (a prefill chunk short of its prompt's end; every step of a pipeline
stage before the last) is read back as soon as it is launched: the host's clock sees its launch
alone. ``StepTimer`` records a start and an end event around such a step's GPU work on the current
stream and, when asked (``completed``), returns the steps whose end event has completed
(``event.query()``), in launch order, with their GPU seconds (``start.elapsed_time(end)``) and
their start and end on the wall clock: an origin event recorded right after a synchronisation at
construction, with ``time.time()`` then; a step starts ``origin.elapsed_time(start)`` after it.
The origin moves to a completed step's end once it is ``REANCHOR_S`` old (``elapsed_time`` is a
single-precision float of milliseconds: a fixed origin would lose sub-millisecond precision
within hours). The wall times drift from the host's clock as the GPU's does (parts per million).

A later pipeline stage's step waits on its stream for the previous stage's activations and an
earlier stage's for its previous send: the stage calls ``work_started`` once its input is in and
``work_done`` before it sends (``models.pipeline.PipelineStage``'s hooks), so neither wait counts.

Bounded: beyond ``max_outstanding`` steps not yet complete the oldest is dropped (never reported).
Without an event source the timer is disabled (every call a no-op): on a device other than CUDA a
step is done when launched, and its ``execute_seconds`` is already its time. The events and the
clocks are injected (``EventSource``: CUDA's from ``runner/gpu_events.py``, fakes in CPU tests).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from vllm_actors.protocol.messages import StepGpuTime

MAX_OUTSTANDING = 1_024  # steps timed and not complete yet; the oldest beyond are dropped
REANCHOR_S = 60.0  # seconds after which the wall-clock origin moves to a completed event
MAX_FREE_EVENTS = 64  # completed events kept for reuse (creating one per step costs host time)


class TimingEvent(Protocol):
    """What the timer uses of ``torch.cuda.Event(enable_timing=True)``."""

    def record(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: TimingEvent) -> float: ...  # milliseconds, both complete


@dataclass(frozen=True)
class EventSource:
    """Timing events and the clocks they are read against (CUDA's; fakes in tests)."""

    new_event: Callable[[], TimingEvent]
    synchronize: Callable[[], None]  # at construction only: the origin event is then complete
    wall: Callable[[], float]  # time.time


@dataclass
class _Timed:
    step_id: int
    start: TimingEvent
    end: TimingEvent | None = None  # set by ``work_done`` (before a send) or at ``end``


class StepTimer:
    def __init__(self, source: EventSource | None = None, max_outstanding: int = MAX_OUTSTANDING) -> None:
        """``source``: None disables the timer."""
        self.source = source
        self.max_outstanding = max_outstanding
        self.num_dropped = 0  # steps dropped unreported (more than max_outstanding outstanding)
        self._open: _Timed | None = None  # the step being launched
        self._outstanding: deque[_Timed] = deque()  # launched, in launch order, not seen complete
        self._free: list[TimingEvent] = []
        self._origin: TimingEvent | None = None
        self._origin_wall = 0.0
        if source is not None:
            source.synchronize()  # the device idle: the origin completes at once, at about ``wall()``
            self._origin = source.new_event()
            self._origin.record()
            source.synchronize()
            self._origin_wall = source.wall()

    @property
    def enabled(self) -> bool:
        return self.source is not None

    @property
    def num_outstanding(self) -> int:
        return len(self._outstanding)

    def _event(self) -> TimingEvent:
        assert self.source is not None
        return self._free.pop() if self._free else self.source.new_event()

    # ------------------------------------------------------------------ around a step
    def begin(self, step_id: int) -> None:
        """Before the step's GPU work is queued."""
        if self.source is None:
            return
        start = self._event()
        start.record()
        self._open = _Timed(step_id, start)

    def work_started(self) -> None:
        """The step's input is in (a later stage's receive): its work starts here, not at ``begin``."""
        if self._open is not None and self._open.end is None:
            self._open.start.record()

    def work_done(self) -> None:
        """The step's work is queued (before an earlier stage's send, which may wait for the one before)."""
        if self._open is not None and self._open.end is None:
            self._open.end = self._event()
            self._open.end.record()

    def end(self) -> None:
        """After the step's GPU work is queued: it is outstanding until its end event completes."""
        timed, self._open = self._open, None
        if timed is None:
            return
        if timed.end is None:
            timed.end = self._event()
            timed.end.record()
        self._outstanding.append(timed)
        if len(self._outstanding) > self.max_outstanding:
            self._outstanding.popleft()  # its events may still be queued: not reused
            self.num_dropped += 1

    # ------------------------------------------------------------------ polling
    def any_done(self) -> bool:
        """Whether the oldest outstanding step is complete (``completed`` would return it)."""
        return bool(self._outstanding) and self._end_of(self._outstanding[0]).query()

    def completed(self) -> list[StepGpuTime]:
        """The outstanding steps complete now, oldest first, forgotten: one stream runs them in
        launch order, so the first one not complete ends the look (nothing after it is queried)."""
        done: list[StepGpuTime] = []
        while self._outstanding and self._end_of(self._outstanding[0]).query():
            done.append(self._measure(self._outstanding.popleft()))
        return done

    @staticmethod
    def _end_of(timed: _Timed) -> TimingEvent:
        assert timed.end is not None
        return timed.end

    def _measure(self, timed: _Timed) -> StepGpuTime:
        assert self._origin is not None
        end = self._end_of(timed)
        seconds = timed.start.elapsed_time(end) / 1e3
        start_wall = self._origin_wall + self._origin.elapsed_time(timed.start) / 1e3
        measured = StepGpuTime(timed.step_id, seconds, start_wall, start_wall + seconds)
        reuse = [timed.start]
        if measured.end - self._origin_wall >= REANCHOR_S:  # the origin moves on to this end
            self._free.append(self._origin)
            self._origin, self._origin_wall = end, measured.end
        else:
            reuse.append(end)
        for event in reuse:
            if len(self._free) < MAX_FREE_EVENTS:
                self._free.append(event)
        return measured
