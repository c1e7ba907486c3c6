"""The pipeline's bubble fraction per stage, from every stage's STEP_FINISHED.

A stage's step is busy from its event's time less its ``execute_ms`` to its event's time (as the
Chrome trace draws it). The window is the time the pipeline works: the union of every stage's
steps, gaps under ``IDLE_GAP`` included (a scheduler round trip, a stage waiting for its input),
longer ones left out (no request to run). A stage's bubble fraction is the share of the window it
was not busy. Only a pipeline (a replica whose earlier stages report their part) is counted, unless
a single stage is asked for too (a benchmark's table of one prefill at PP=1)."""

from __future__ import annotations

import bisect

from vllm_actors.protocol.events import StepFinished
from vllm_actors.protocol.names import split_replica

IDLE_GAP = 0.1  # seconds with no stage busy: the pipeline idles rather than waits
MAX_OPEN = 256  # merged spans kept open for steps reported late; older ones are summed and closed


class _Window:
    """The union of intervals given in nearly increasing order, in bounded memory: the oldest
    merged spans are closed (summed); an interval reaching before them is clipped."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.closed = 0.0
        self.frontier = float("-inf")

    def add(self, start: float, end: float) -> None:
        start = max(start, self.frontier)
        if end <= start:
            return
        index = bisect.bisect_left(self.ends, start - IDLE_GAP)  # the first span it may touch
        last = index
        while last < len(self.starts) and self.starts[last] <= end + IDLE_GAP:
            start, end = min(start, self.starts[last]), max(end, self.ends[last])
            last += 1
        self.starts[index:last] = [start]
        self.ends[index:last] = [end]
        if len(self.starts) > MAX_OPEN:
            self.closed += self.ends[0] - self.starts[0]
            self.frontier = self.ends[0]
            del self.starts[0], self.ends[0]

    @property
    def seconds(self) -> float:
        return self.closed + sum(end - start for start, end in zip(self.starts, self.ends))


class _Pipeline:
    def __init__(self) -> None:
        self.window = _Window()
        self.busy: dict[int | None, float] = {}  # stage (None: the last) -> busy seconds

    def fractions(self, suffix: str, single_stage: bool) -> dict[str, float]:
        window = self.window.seconds
        earlier = [stage for stage in self.busy if stage is not None]
        if (not earlier and not single_stage) or window <= 0.0:
            return {}
        last = max(earlier, default=-1) + 1
        named = {(last if stage is None else stage): busy for stage, busy in self.busy.items()}
        return {f"stage {stage}{suffix}": min(1.0, max(0.0, 1.0 - named[stage] / window)) for stage in sorted(named)}


class PipelineBubbles:
    """Per replica: each stage's busy seconds and the pipeline's window."""

    def __init__(self) -> None:
        self._pipelines: dict[int | None, _Pipeline] = {}

    def step(self, actor: str, wall: float, event: StepFinished) -> None:
        _, replica = split_replica(actor)
        pipeline = self._pipelines.get(replica)
        if pipeline is None:
            pipeline = self._pipelines[replica] = _Pipeline()
        seconds = max(event.execute_ms, 0.0) / 1e3
        pipeline.window.add(wall - seconds, wall)
        pipeline.busy[event.stage] = pipeline.busy.get(event.stage, 0.0) + seconds

    def fractions(self, single_stage: bool = False) -> dict[str, float]:
        """``{"stage 0": 0.12, "stage 1": 0.08}`` (``"stage 0@1"`` for replica 1 of a set); with
        ``single_stage``, a replica of one stage too (``{"stage 0": ...}``)."""
        found: dict[str, float] = {}
        for replica, pipeline in self._pipelines.items():
            found.update(pipeline.fractions("" if replica is None else f"@{replica}", single_stage))
        return found
