"""``benchmarks/long_context.py --trace``, in our engine's process: one request's events read from
the metrics store through the engine's client (``EventsQuery`` pages from the store's index before
the request was sent), written as a Chrome trace of that request's window alone
(observe.trace_file: bounded to ``DEFAULT_MAX_TRACE_BYTES``) and reduced to its table of prefill
chunks (long_context_chunks)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.lib.long_context_chunks import chunk_table
from vllm_actors.observe.trace import TraceRow
from vllm_actors.observe.trace_file import trace_record, write_trace
from vllm_actors.protocol.events import Aborted, Finished, PrefillChunk, StepFinished, StepTimed
from vllm_actors.protocol.metrics import EventsQuery, EventsReply, MetricsQuery, MetricsReply

Query = Callable[[MetricsQuery], MetricsReply]
WAIT_S = 10.0  # the longest the store may take to receive the request's last events after its end
POLL_S = 0.05
PAGE = 10_000  # the store's most events per query


def _events(query: Query, since_index: int, limit: int = PAGE) -> EventsReply:
    reply = query(EventsQuery(since_index=since_index, limit=limit))
    if not isinstance(reply, EventsReply):
        raise RuntimeError(f"the metrics store answered {reply!r}")
    return reply


def events_index(query: Query) -> int:
    """The store's index of the next event it will log: where a request sent now starts."""
    return _events(query, -1, 1).next_index


def read_since(query: Query, since_index: int) -> tuple[list[TraceRow], int, int]:
    """Every retained event from ``since_index`` on, how many of them the store no longer held,
    and the index to read on from."""
    rows: list[TraceRow] = []
    missed = 0
    while True:
        reply = _events(query, since_index)
        missed += reply.missed
        rows += [(entry.actor, entry.seq, entry.mono, entry.wall, entry.event) for entry in reply.events]
        if not reply.events:
            return rows, missed, reply.next_index
        since_index = reply.next_index


def is_complete(rows: list[TraceRow], request_id: str, num_stages: int) -> bool:
    """The request ended and every stage reported the step of each of its prefill chunks; where the
    workers time steps on the GPU (any STEP_TIMED seen), also the GPU time of each that sampled
    nothing (published once the GPU is done with it, after its STEP_FINISHED)."""
    ended = any(isinstance(event, Finished | Aborted) and event.request_id == request_id for *_, event in rows)
    steps = {event.step_id for *_, event in rows if isinstance(event, PrefillChunk) and event.request_id == request_id}
    finished = [event for *_, event in rows if isinstance(event, StepFinished)]
    reported = {(event.step_id, event.stage) for event in finished}
    stages = [*range(num_stages - 1), None]  # the last stage's events carry None
    if not (ended and bool(steps) and all((step, stage) in reported for step in steps for stage in stages)):
        return False
    timed = {(event.step_id, event.stage) for *_, event in rows if isinstance(event, StepTimed)}
    return not timed or all((event.step_id, event.stage) in timed for event in finished
                            if event.step_id in steps and event.num_sampled == 0)


def request_window(rows: list[TraceRow], request_id: str) -> list[TraceRow]:
    """The rows from the request's first event to its end (by wall clock): every actor's, so that
    its steps and the stages' tracks are in the trace; the events of requests before it left out."""
    own = [wall for *_, wall, event in rows if getattr(event, "request_id", None) == request_id]
    if not own:
        return []
    first, last = min(own), max(own)
    return [row for row in rows if first <= row[3] <= last or getattr(row[4], "request_id", None) == request_id]


def capture(query: Query, since_index: int, request_id: str, num_stages: int, path: Path,
            wait_s: float = WAIT_S) -> dict[str, Any]:
    """The request's trace written at ``path`` and its chunk table: what the report keeps."""
    deadline = time.monotonic() + wait_s
    rows, missed, since_index = read_since(query, since_index)
    while not is_complete(rows, request_id, num_stages) and time.monotonic() < deadline:
        time.sleep(POLL_S)
        more, more_missed, since_index = read_since(query, since_index)
        rows, missed = rows + more, missed + more_missed
    window = request_window(rows, request_id)
    written = write_trace(window, path)
    return {"file": path.name, "trace": trace_record(written), "missed_events": missed,
            "complete": is_complete(rows, request_id, num_stages),
            "chunks": chunk_table(window, request_id, num_stages)}
