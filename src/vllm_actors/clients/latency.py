"""Latency samples of an ``AsyncEngineClient``'s requests, for its stats listeners.

TTFT, inter-token latency and end-to-end time are what the client sees (its own clock, from the
moment it submitted the request); the queue time, QUEUED to SCHEDULED, comes from the scheduler's
events on the bus (one clock, the scheduler's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import structlog

from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.protocol.events import EventBatch, Queued, Scheduled
from vllm_actors.protocol.names import parent_request_id

log = structlog.get_logger(__name__)


class StatsListener(Protocol):
    """Receives latency samples of this client's requests, in seconds: ``"ttft"``, ``"itl"``
    (one per step that brought tokens), ``"e2e"`` and ``"queue"`` (QUEUED to SCHEDULED)."""

    def observe(self, metric: str, seconds: float) -> None: ...


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    queued: dict[str, float] = field(default_factory=dict)  # engine id -> QUEUED (scheduler mono)


class LatencyTracker:
    def __init__(self) -> None:
        self.listeners: list[StatsListener] = []
        self._timings: dict[str, _Timing] = {}

    def start(self, request_id: str, now: float) -> None:
        self._timings[request_id] = _Timing(arrival=now)

    def forget(self, request_id: str) -> None:
        self._timings.pop(request_id, None)

    def clear(self) -> None:
        self._timings.clear()

    def on_output(self, output: RequestOutput, now: float) -> None:
        """An output reached the client at ``now``; a finished one ends the request's timing."""
        timing = self._timings.get(output.request_id)
        if timing is not None and self.listeners:
            self._observe_progress(timing, output, now)
        if output.finished:
            self._timings.pop(output.request_id, None)

    def _observe_progress(self, timing: _Timing, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if num_tokens > timing.num_tokens:
            if timing.first_token is None:
                timing.first_token = now
                self._emit("ttft", now - timing.arrival)
            elif timing.last_token is not None:
                self._emit("itl", now - timing.last_token)
            timing.last_token = now
            timing.num_tokens = num_tokens
        if output.finished and output.error is None:
            self._emit("e2e", now - timing.arrival)

    def on_scheduler_events(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, Queued | Scheduled):
                timing = self._timings.get(parent_request_id(event.request_id))
                if timing is None:
                    continue
                if isinstance(event, Queued):
                    timing.queued[event.request_id] = batch.mono
                elif event.request_id in timing.queued:
                    self._emit("queue", max(batch.mono - timing.queued.pop(event.request_id), 0.0))

    @property
    def wants_scheduler_events(self) -> bool:
        """Whether scheduler events are worth decoding: listeners, and requests being timed."""
        return bool(self.listeners and self._timings)

    def _emit(self, metric: str, seconds: float) -> None:
        for listener in self.listeners:
            try:
                listener.observe(metric, seconds)
            except Exception:
                log.exception("stats listener failed", metric=metric)
