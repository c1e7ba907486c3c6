"""``clients/latency.py``: the client's latency samples, pure (no sockets, no clock)."""

from __future__ import annotations

import pytest

from vllm_actors.actors.frontend.outputs import CompletionOutput, RequestOutput
from vllm_actors.clients import latency
from vllm_actors.clients.latency import LatencyTracker
from vllm_actors.protocol.events import EventBatch, Queued, Scheduled
from vllm_actors.protocol.messages import RequestUpdates


class Samples:
    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def observe(self, metric: str, seconds: float) -> None:
        self.seen.append((metric, seconds))


def output(request_id: str, tokens: list[int], finished: bool) -> RequestOutput:
    completion = CompletionOutput(index=0, text="", token_ids=tokens, cumulative_logprob=None, logprobs=None,
                                  finish_reason="length" if finished else None)
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[1, 2], prompt_logprobs=None,
                         outputs=[completion], finished=finished)


def batch(mono: float, *events: Queued | Scheduled) -> EventBatch:
    return EventBatch(actor="scheduler", first_seq=0, mono=mono, wall=0.0, events=list(events))


def test_a_queue_time_arriving_after_its_request_finished_still_counts() -> None:
    """The bus is a hop longer than the outputs: a short request can finish before its SCHEDULED
    event arrives; the sample is taken when it does, once, and the request is then forgotten."""
    tracker, samples = LatencyTracker(), Samples()
    tracker.listeners.append(samples)
    tracker.start("r", now=10.0)
    tracker.on_scheduler_events(batch(10.1, Queued(request_id="r", num_waiting=1)))
    tracker.on_output(output("r", [5], finished=False), now=10.5)
    tracker.on_output(output("r", [5, 6], finished=True), now=10.6)
    assert "queue" not in dict(samples.seen) and tracker.wants_scheduler_events
    tracker.on_scheduler_events(batch(10.3, Scheduled(request_id="r", step_id=1)))
    assert [round(s, 6) for m, s in samples.seen if m == "queue"] == [0.2]
    assert not tracker.wants_scheduler_events  # nothing more awaited
    tracker.on_scheduler_events(batch(10.4, Scheduled(request_id="r", step_id=2)))
    assert len([m for m, _ in samples.seen if m == "queue"]) == 1


def test_late_frames_are_logged_once_a_second_with_their_count_and_worst(
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    lines: list[dict[str, object]] = []
    monkeypatch.setattr(latency.log, "warning", lambda event, **fields: lines.append({"event": event, **fields}))
    tracker, samples = LatencyTracker(), Samples()
    tracker.listeners.append(samples)
    for step, (sent, received) in enumerate([(10.0, 10.01), (10.0, 10.3), (10.2, 10.35), (10.5, 10.9), (11.0, 11.35)]):
        tracker.on_transit(RequestUpdates(step_id=step, updates=[], step_finished_at=sent), now=received)
    assert [round(s, 3) for m, s in samples.seen if m == "transit"] == [0.01, 0.3, 0.15, 0.4, 0.35]
    # step 0 is on time; step 1 logs at once; 2 and 3 within the second are summed into the line of step 4
    assert [(line["frames"], line["worst_ms"], line["worst_step"], line["last_step"]) for line in lines] == \
        [(1, 300.0, 1, 1), (3, 400.0, 3, 4)]
