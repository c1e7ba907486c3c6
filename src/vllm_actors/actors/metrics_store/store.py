"""The metrics store: a pure state machine fed every ``EventBatch`` of the bus, answering queries.

``record`` takes each batch as it comes off the bus and returns what it has to say about the
stream (``notices``: gaps, stale batches, restarts, dropped records) for the shell to log;
``query`` answers a ``MetricsQuery``. No sockets, no clock, no files, no logger: the shell around
it (``vllm_actors.runtime.metrics_shell``) subscribes to the bus, serves the queries, logs the
notices and writes the file of a ``DumpQuery``, whose answer here is a ``DumpContent``.

What it keeps, all bounded:

* the event log: the last ``max_events`` events, as (actor, seq, mono, wall, event), within
  ``max_history_bytes`` (estimated: ``bounds.event_bytes``);
* every event bounded on arrival (``bounds.bounded``): request and actor ids over
  ``MAX_ID_CHARS`` shortened to a prefix and a digest, other text cut at ``MAX_TEXT_CHARS``, so
  what a client sends (a 60 KB request id) is never copied into every event naming it;
* per actor (every engine actor, the last ``ingest.MAX_CLIENTS`` clients): the sequence check
  (gaps, stale batches, restarts; see ``SequenceTracker``) and the last lifecycle state; an actor
  first seen past sequence 0 (this store restarted, or joined late) counts a gap of the events it
  never saw, unless that first batch is a start-up handshake (STARTING, HEARTBEAT: the ones before
  it were lost to the slow joiner);
* per request: its timeline (its request events, TOKENS narrowed to it, and its ALLOCATED / FREED)
  and the stamps its latencies need; open requests until they end, then the last
  ``max_finished_requests`` ended ones; all of them within ``max_request_bytes`` (the oldest
  ended records go first; past it, open ones take no more bulk entries);
* trust: a batch whose actor is not its bus topic, and events a client may not publish (it may
  publish ARRIVED, FINISHED "stop"/"error", ABORTED, HEARTBEAT, its own lifecycle), are counted,
  not applied;
* supervision: failures and restarts per actor, restart times, pipeline resets, a group failure;
* running aggregates: counters (at most ``bounds.MAX_COUNTED_KEYS`` reasons each), gauges
  (running, waiting, KV blocks in use) and bounded sample windows for the latency percentiles,
  sorted again only when they changed since the last summary.

Where each lives: ``ingest`` (recording), ``request_table`` and ``records`` (requests),
``aggregates`` (counters, samples, KV pools), ``queries`` (replies), ``dump`` (the dump's lines).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from vllm_actors.actors.metrics_store import queries
from vllm_actors.actors.metrics_store.bounds import cap_id
from vllm_actors.actors.metrics_store.dump import DumpContent
from vllm_actors.actors.metrics_store.ingest import Recorder
from vllm_actors.actors.metrics_store.notices import Notice
from vllm_actors.actors.metrics_store.records import RequestState
from vllm_actors.protocol.events import EventBatch
from vllm_actors.protocol.metrics import (
    DumpQuery,
    ErrorReply,
    EventsQuery,
    MetricsQuery,
    MetricsReply,
    SeenQuery,
    SummaryQuery,
    SummaryReply,
    TimelineQuery,
)
from vllm_actors.protocol.names import split_replica

_NO_NOTICES: tuple[Notice, ...] = ()


# What the store retains by default: a few minutes of a busy server (about 15 requests a second
# make 10-15 events each), so that its memory levels off within minutes; older history lives in
# dumps and the bus's taps.
DEFAULT_MAX_EVENTS = 50_000
DEFAULT_MAX_FINISHED_REQUESTS = 4_096
MAX_REPLICAS = 64  # replicas summarised one by one (their actors' ids carry "@<replica>")

class MetricsStore:
    """Records every event batch of the bus; answers ``MetricsQuery``s with ``MetricsReply``s
    (a ``DumpQuery`` with the ``DumpContent`` its shell writes)."""

    def __init__(
        self,
        max_events: int = DEFAULT_MAX_EVENTS,
        max_finished_requests: int = DEFAULT_MAX_FINISHED_REQUESTS,
        *,
        max_open_requests: int = 50_000,
        max_timeline_events: int = 2_048,
        sample_window: int = 10_000,
        max_history_bytes: int = 32 << 20,
        max_request_bytes: int = 32 << 20,
    ) -> None:
        for name, value in (("max_events", max_events), ("max_finished_requests", max_finished_requests),
                            ("max_open_requests", max_open_requests), ("max_history_bytes", max_history_bytes),
                            ("max_request_bytes", max_request_bytes),
                            ("max_timeline_events", max_timeline_events), ("sample_window", sample_window)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.max_events = max_events
        self.max_finished_requests = max_finished_requests
        self.max_open_requests = max_open_requests
        self.max_timeline_events = max_timeline_events
        self._recorder = Recorder(max_events=max_events, max_finished_requests=max_finished_requests,
                                  max_open_requests=max_open_requests, max_timeline_events=max_timeline_events,
                                  sample_window=sample_window, max_history_bytes=max_history_bytes,
                                  max_request_bytes=max_request_bytes)
        # Replica sets: one more recorder per replica, fed only its own actors' batches (counters,
        # gauges, latencies per replica; no event log of its own). Bounded by MAX_REPLICAS.
        self._replica_limits = {"max_finished_requests": max_finished_requests, "max_open_requests": max_open_requests,
                                "max_timeline_events": 1, "sample_window": sample_window,
                                "max_request_bytes": max_request_bytes}
        self._replicas: dict[int, Recorder] = {}

    def record(self, batch: EventBatch, topic: str | None = None) -> Sequence[Notice]:
        """Apply one batch from the bus (in the order the bus delivered it); return its notices.
        ``topic``: the bus topic it came under, which the bus checked against the publisher's
        endpoint; a batch naming another actor is not applied (None: no check, in process).
        A client (an actor id that is no engine actor's) may publish only client events
        (``trust.CLIENT_EVENTS``); its other events are counted and not applied."""
        recorder = self._recorder
        recorder.record(batch, topic)
        _, replica = split_replica(batch.actor)
        if replica is not None and (topic is None or topic == batch.actor):
            own = self._replicas.get(replica)
            if own is None and len(self._replicas) < MAX_REPLICAS:
                own = self._replicas[replica] = Recorder(max_events=1, max_history_bytes=1 << 10,
                                                         **self._replica_limits)
            if own is not None:
                own.record(batch, topic)
                own.notices.clear()  # the group's recorder reports the stream's troubles
        notices = recorder.notices
        if not notices:
            return _NO_NOTICES
        drained = list(notices)
        notices.clear()  # the recorder's parts share this list: empty it in place
        return drained

    def query(self, query: MetricsQuery) -> MetricsReply | DumpContent:
        """Answer one query: an ``ErrorReply`` for one it cannot answer; for a ``DumpQuery``, the
        ``DumpContent`` that its shell writes to a file it names (and then replies ``DumpReply``)."""
        recorder = self._recorder
        if isinstance(query, SummaryQuery):
            return self.summary(query.replica)
        if isinstance(query, TimelineQuery):
            return queries.timeline(recorder, query)
        if isinstance(query, SeenQuery):
            return queries.seen(recorder, query)
        if isinstance(query, EventsQuery):
            return queries.events(recorder, query)
        if isinstance(query, DumpQuery):
            return queries.dump(recorder, query)
        return ErrorReply(message=f"unknown query: {type(query).__name__}")

    def summary(self, replica: int | None = None) -> SummaryReply:
        """The whole group's summary, or one replica's (``SummaryQuery.replica``)."""
        replicas = sorted(self._replicas)
        if replica is None or (replica == 0 and not replicas):
            reply = queries.summary(self._recorder)
            return msgspec.structs.replace(reply, replicas=replicas, replica=replica)
        own = self._replicas.get(replica) if isinstance(replica, int) else None
        if own is None:
            return SummaryReply(replicas=replicas, replica=replica)  # not heard from (yet): nothing counted
        return msgspec.structs.replace(queries.summary(own), replicas=replicas, replica=replica)

    # ------------------------------------------------------------------ introspection (tests, shells)
    @property
    def num_events(self) -> int:
        return self._recorder.num_events

    @property
    def num_retained(self) -> int:
        return len(self._recorder.history)

    @property
    def retained_bytes(self) -> int:
        """Estimated bytes of the event log and the request records."""
        recorder = self._recorder
        return recorder.history.nbytes + recorder.requests.nbytes

    def table_sizes(self) -> dict[str, int]:
        """How many entries each per-request or per-actor table holds (tests, soak figures)."""
        recorder = self._recorder
        requests = recorder.requests
        return {
            "history": len(recorder.history), "open": len(requests.open), "ended": len(requests.ended),
            "children": len(requests.children), "running": len(requests.running),
            "waiting": len(requests.waiting), "actors": len(recorder.actors),
            "kv_blocks": sum(len(pool.blocks) for pool in recorder.kv.values()),
        }

    def request_state(self, request_id: str) -> RequestState | None:
        record = self._recorder.requests.find(cap_id(request_id))
        return None if record is None else record.state
