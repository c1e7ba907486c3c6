"""Latency samples of an ``AsyncEngineClient``'s requests, for its stats listeners.

TTFT, inter-token latency and end-to-end time are what the client sees (its own clock, from the
moment it submitted the request); the queue time, QUEUED to SCHEDULED, comes from the scheduler's
events on the bus (one clock, the scheduler's). As in vLLM, a request with ``n`` > 1 is ``n``
engine requests (children): each child's samples are its own, and ``params_n`` and
``max_num_generation_tokens`` are observed once, when its last child finishes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from vllm_actors.actors.frontend.outputs import CompletionOutput, RequestOutput
from vllm_actors.protocol.events import EventBatch, Queued, Scheduled
from vllm_actors.protocol.messages import RequestUpdates
from vllm_actors.protocol.names import CHILD_SEPARATOR, parent_request_id

log = structlog.get_logger(__name__)

# A frame this late on its way from the worker (a stalled scheduler, controller, socket or event loop) is logged
# (``slow_transit``), at most once per SLOW_LOG_INTERVAL with the count and the worst since: the 1M stream on an
# H200 (RESULTS.md, twenty-fifth session) had 1% of frames in the 200-500 ms bucket, and nothing said when.
SLOW_TRANSIT = 0.1
SLOW_LOG_INTERVAL = 1.0


class StatsListener(Protocol):
    """Receives samples of this client's requests, per engine request (each child of an ``n`` > 1
    request). In seconds: ``"ttft"``, ``"itl"`` (one per step that brought tokens), ``"e2e"``,
    ``"queue"`` (QUEUED to SCHEDULED), and for a child that finished well ``"prefill"`` (TTFT less
    its queue time), ``"decode"`` (first to last token), ``"inference"`` (their sum) and
    ``"time_per_output_token"`` (decode over the tokens after the first, 0 for one token).
    Counts, once per such child: ``"prompt_tokens"``, ``"prefill_kv_computed_tokens"`` (the prompt
    less its tokens found in the prefix cache), ``"generation_tokens"`` and
    ``"params_max_tokens"`` (when it had one); once per request: ``"params_n"`` and
    ``"max_num_generation_tokens"`` (its longest child)."""

    def observe(self, metric: str, seconds: float) -> None: ...


@dataclass
class _Child:
    """One engine request's progress, as the client sees it."""

    queue_seconds: float = 0.0  # QUEUED to SCHEDULED
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    done: bool = False


@dataclass
class _Timing:
    arrival: float
    n: int = 1
    max_tokens: int | None = None
    children: dict[int, _Child] = field(default_factory=dict)
    num_queue_samples: int = 0  # QUEUED -> SCHEDULED pairs seen (one per child, a preempted one again)
    queued: dict[str, float] = field(default_factory=dict)  # engine id -> QUEUED (scheduler mono)

    def child(self, index: int) -> _Child:
        found = self.children.get(index)
        if found is None:
            found = self.children[index] = _Child()
        return found


def _child_index(engine_id: str) -> int:
    """The completion index an engine request id names (``"r#2"`` -> 2; ``"r"`` -> 0)."""
    _, separator, index = engine_id.rpartition(CHILD_SEPARATOR)
    return int(index) if separator and index.isdigit() else 0


MAX_AWAITING_QUEUE = 4096  # finished requests whose queue time may still come on the bus


class LatencyTracker:
    def __init__(self) -> None:
        self.listeners: list[StatsListener] = []
        self._timings: dict[str, _Timing] = {}
        # Finished requests some of whose children's SCHEDULED event has not come yet: the bus is a
        # hop longer than the updates, so a short request can finish before it (oldest dropped).
        self._awaiting_queue: OrderedDict[str, _Timing] = OrderedDict()
        self._slow = SlowFrames()

    def start(self, request_id: str, now: float, n: int = 1, max_tokens: int | None = None) -> None:
        self._timings[request_id] = _Timing(arrival=now, n=n, max_tokens=max_tokens)

    def forget(self, request_id: str) -> None:
        self._timings.pop(request_id, None)
        self._awaiting_queue.pop(request_id, None)

    def clear(self) -> None:
        self._timings.clear()
        self._awaiting_queue.clear()

    def on_output(self, output: RequestOutput, now: float) -> None:
        """An output reached the client at ``now``; a finished one ends the request's timing."""
        timing = self._timings.get(output.request_id)
        if timing is not None and self.listeners:
            for completion in output.outputs:
                self._observe_child(timing, output, completion, now)
            if output.finished and output.error is None:
                self._emit("params_n", timing.n)
                self._emit("max_num_generation_tokens",
                           max((child.num_tokens for child in timing.children.values()), default=0))
        if output.finished:
            timing = self._timings.pop(output.request_id, None)
            if timing is not None and self.listeners and timing.num_queue_samples < timing.n:
                self._awaiting_queue[output.request_id] = timing
                if len(self._awaiting_queue) > MAX_AWAITING_QUEUE:
                    self._awaiting_queue.popitem(last=False)

    def _observe_child(self, timing: _Timing, output: RequestOutput, completion: CompletionOutput,
                       now: float) -> None:
        child = timing.child(completion.index)
        if child.done:
            return
        num_tokens = len(completion.token_ids)
        if num_tokens > child.num_tokens:
            if child.first_token is None:
                child.first_token = now
                self._emit("ttft", now - timing.arrival)
            elif child.last_token is not None:
                self._emit("itl", now - child.last_token)
            child.last_token = now
            child.num_tokens = num_tokens
        finished = completion.finish_reason is not None or output.finished
        if finished and output.error is None:
            child.done = True
            self._emit("e2e", now - timing.arrival)
            self._observe_finished(timing, child, output)

    def _observe_finished(self, timing: _Timing, child: _Child, output: RequestOutput) -> None:
        if child.first_token is not None and child.last_token is not None:
            prefill = max(child.first_token - timing.arrival - child.queue_seconds, 0.0)
            decode = child.last_token - child.first_token
            self._emit("prefill", prefill)
            self._emit("decode", decode)
            self._emit("inference", prefill + decode)
            self._emit("time_per_output_token", decode / (child.num_tokens - 1) if child.num_tokens > 1 else 0.0)
        num_prompt = len(output.prompt_token_ids)
        self._emit("prompt_tokens", num_prompt)
        self._emit("prefill_kv_computed_tokens", num_prompt - max(output.num_cached_tokens, 0))
        self._emit("generation_tokens", child.num_tokens)
        if timing.max_tokens is not None:
            self._emit("params_max_tokens", timing.max_tokens)

    def on_scheduler_events(self, batch: EventBatch) -> None:
        for event in batch.events:
            if isinstance(event, Queued | Scheduled):
                parent = parent_request_id(event.request_id)
                timing = self._timings.get(parent) or self._awaiting_queue.get(parent)
                if timing is None:
                    continue
                if isinstance(event, Queued):
                    timing.queued[event.request_id] = batch.mono
                elif event.request_id in timing.queued:
                    seconds = max(batch.mono - timing.queued.pop(event.request_id), 0.0)
                    child = timing.child(_child_index(event.request_id))
                    if not child.queue_seconds:
                        child.queue_seconds = seconds
                    timing.num_queue_samples += 1
                    self._emit("queue", seconds)
                    if timing.num_queue_samples >= timing.n:
                        self._awaiting_queue.pop(parent, None)

    @property
    def wants_scheduler_events(self) -> bool:
        """Whether scheduler events are worth decoding: listeners, and requests being timed."""
        return bool(self.listeners and (self._timings or self._awaiting_queue))

    def on_transit(self, updates: RequestUpdates, now: float) -> None:
        """A frame of the scheduler's updates reached the client at ``now`` (``time.monotonic``):
        ``"transit"``, from the worker's result leaving it (its shell's stamp) to here, once per
        frame; 0-stamped frames (another host's clock, or none) are not observed."""
        if self.listeners and updates.step_finished_at and updates.step_finished_at <= now:
            seconds = now - updates.step_finished_at
            self._emit("transit", seconds)
            if seconds > SLOW_TRANSIT:
                self._slow.note(updates.step_id, seconds, len(updates.updates), now)

    def on_stream_wait(self, seconds: float) -> None:
        """``"stream_wait"``: how long an output waited in its stream before the consumer (an SSE
        response, a ``generate`` loop) took it: this process's event loop falling behind."""
        if self.listeners:
            self._emit("stream_wait", seconds)

    def _emit(self, metric: str, seconds: float) -> None:
        for listener in self.listeners:
            try:
                listener.observe(metric, seconds)
            except Exception:
                log.exception("stats listener failed", metric=metric)


@dataclass
class SlowFrames:
    """Frames past ``SLOW_TRANSIT``: the first logged at once, later ones summed into one line a
    ``SLOW_LOG_INTERVAL`` (how many, the worst, its step)."""

    logged_at: float | None = None
    count: int = 0
    worst: float = 0.0
    worst_step: int = -1

    def note(self, step_id: int, seconds: float, num_updates: int, now: float) -> None:
        self.count += 1
        if seconds > self.worst:
            self.worst, self.worst_step = seconds, step_id
        if self.logged_at is not None and now - self.logged_at < SLOW_LOG_INTERVAL:
            return
        log.warning("slow_transit", frames=self.count, worst_ms=round(self.worst * 1e3, 1), worst_step=self.worst_step,
                    last_step=step_id, last_updates=num_updates)
        self.logged_at, self.count, self.worst, self.worst_step = now, 0, 0.0, -1
