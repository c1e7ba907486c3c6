"""CUDA timing events without a GPU, for ``actors/worker/gpu_timing.StepTimer``: a fake stream whose
time the test moves. An event recorded at stream time ``clock`` completes once the test says the
device got that far (``reach``); ``elapsed_time`` is the difference of the two record times."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_actors.actors.worker.gpu_timing import EventSource, StepTimer, TimingEvent


@dataclass
class FakeEvent:
    gpu: FakeGpu
    at: float | None = None  # stream time (ms) of its last record

    def record(self) -> None:
        self.at = self.gpu.clock

    def query(self) -> bool:
        self.gpu.num_queries += 1
        return self.at is not None and self.at <= self.gpu.done

    def elapsed_time(self, end_event: TimingEvent) -> float:
        assert isinstance(end_event, FakeEvent) and self.query() and end_event.query(), "not complete"
        assert self.at is not None and end_event.at is not None
        return end_event.at - self.at


@dataclass
class FakeGpu:
    clock: float = 0.0  # stream time (ms) where the next recorded event sits
    done: float = 0.0  # stream time (ms) the device has completed
    wall: float = 1_000.0  # the host's wall clock (s) when the timer synchronises
    num_events: int = 0
    num_queries: int = 0
    synchronized: list[float] = field(default_factory=list)

    def new_event(self) -> FakeEvent:
        self.num_events += 1
        return FakeEvent(self)

    def synchronize(self) -> None:
        self.done = self.clock
        self.synchronized.append(self.clock)

    def run(self, ms: float) -> None:
        """Queue ``ms`` of work on the stream (not done until ``reach``)."""
        self.clock += ms

    def reach(self, ms: float) -> None:
        self.done = ms

    def source(self) -> EventSource:
        return EventSource(self.new_event, self.synchronize, lambda: self.wall)

    def timer(self, max_outstanding: int = 1_024) -> StepTimer:
        return StepTimer(self.source(), max_outstanding)
