"""Checks that an event stream tells each request's story completely and in order."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.observe.tap_format import EVENT_GROUPS
from vllm_actors.protocol.events import EventBatch, Tokens, event_type

TERMINAL = {"FINISHED", "ABORTED"}


def check_sequences(batches: Iterable[EventBatch]) -> dict[str, int]:
    """Per-actor sequence numbers start at the first batch seen and never skip. Returns counts."""
    expected: dict[str, int] = {}
    counts: dict[str, int] = defaultdict(int)
    for batch in batches:
        if batch.actor in expected:
            assert batch.first_seq == expected[batch.actor], (
                f"{batch.actor}: expected seq {expected[batch.actor]}, got {batch.first_seq}"
            )
        expected[batch.actor] = batch.first_seq + len(batch.events)
        counts[batch.actor] += len(batch.events)
    return dict(counts)


def request_stories(batches: Iterable[EventBatch]) -> dict[str, list[tuple[str, object]]]:
    """Request id -> [(type, event)] in stream order (per actor ordered by sequence)."""
    stories: dict[str, list[tuple[str, object]]] = defaultdict(list)
    for batch in batches:
        for event in batch.events:
            kind = event_type(event)
            if isinstance(event, Tokens):
                for request_id in event.request_ids:
                    stories[request_id].append((kind, event))
            elif hasattr(event, "request_id"):
                stories[event.request_id].append((kind, event))
    return dict(stories)


def check_story(request_id: str, story: list[tuple[str, object]]) -> None:
    """The scheduler's grammar: QUEUED SCHEDULED (PREFILL_CHUNK+ [PREEMPTED RESUMED ...])
    FIRST_TOKEN TOKENS+ ... ending in exactly one FINISHED or ABORTED; ARRIVED before the end.
    With two steps in flight, FIRST_TOKEN / TOKENS may follow PREEMPTED (sampled by the step in
    flight when it was preempted)."""
    # KV-cache events come from another actor: the bus orders them per actor, not against these.
    kinds = [kind for kind, _ in story if kind not in EVENT_GROUPS["KV"]]
    assert kinds.count("ARRIVED") == 1, (request_id, kinds)
    terminals = [kind for kind in kinds if kind in TERMINAL]
    assert len(terminals) == 1, (request_id, kinds)
    engine_side = [kind for kind in kinds if kind != "ARRIVED"]
    state = "new"
    for kind in engine_side:
        if kind == "QUEUED":
            assert state == "new", (request_id, kinds)
            state = "waiting"
        elif kind in ("SCHEDULED", "RESUMED"):
            assert state == ("waiting" if kind == "SCHEDULED" else "preempted"), (request_id, kinds)
            state = "prefill"
        elif kind == "PREFILL_CHUNK":
            assert state == "prefill", (request_id, kinds)
        elif kind == "FIRST_TOKEN":
            assert state in ("prefill", "preempted"), (request_id, kinds)
            if state != "preempted":
                state = "decode"
        elif kind == "TOKENS":
            # prefill: after a resume; preempted: the token of a step that was in flight then.
            assert state in ("decode", "prefill", "preempted"), (request_id, kinds)
            if state != "preempted":
                state = "decode"
        elif kind == "PREEMPTED":
            assert state in ("prefill", "decode"), (request_id, kinds)
            state = "preempted"
        elif kind in TERMINAL:
            state = "done"
        else:
            raise AssertionError(f"{request_id}: unexpected {kind} in {kinds}")
    assert state == "done", (request_id, kinds)


def check_against_outputs(stories: dict[str, list[tuple[str, object]]], outputs: list[RequestOutput]) -> None:
    """The timeline's end agrees with what the client got: finish reason and token count."""
    for output in outputs:
        for completion in output.outputs:
            engine_id = output.request_id if len(output.outputs) == 1 else f"{output.request_id}#{completion.index}"
            story = stories[engine_id]
            check_story(engine_id, story)
            kind, last = next((k, e) for k, e in reversed(story) if k in TERMINAL)
            if kind == "FINISHED":
                assert last.reason == completion.finish_reason, (engine_id, last, completion.finish_reason)
                assert last.num_output_tokens == len(completion.token_ids), (engine_id, last)
            else:
                assert completion.finish_reason == "abort", (engine_id, completion.finish_reason)


def settled_metrics(llm, predicate, timeout: float = 60.0):  # noqa: ANN001, ANN201
    """The metrics store hears each actor on its own pipe, a few milliseconds after the client
    hears the scheduler: wait until ``predicate(summary)`` holds, return the summary."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        metrics = llm.get_metrics()
        if predicate(metrics) or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)
