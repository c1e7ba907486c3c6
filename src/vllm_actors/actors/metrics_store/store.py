"""The metrics store: a pure state machine fed every ``EventBatch`` of the bus, answering queries.

``record`` takes each batch as it comes off the bus; ``query`` answers a ``MetricsQuery`` (the
only I/O is ``DumpQuery``, which writes a file). No sockets, no clock: the ZMQ shell around it
subscribes to the bus and serves the queries.

What it keeps, all bounded:

* the event log: the last ``max_events`` events, as (actor, seq, mono, wall, event);
* per actor: the sequence check (gaps, stale batches, restarts; see ``SequenceTracker``) and the
  last lifecycle state;
* per request: its timeline (its request events, TOKENS narrowed to it, and its ALLOCATED / FREED)
  and the stamps its latencies need; open requests until they end, then the last
  ``max_finished_requests`` ended ones;
* running aggregates: counters, gauges (running, waiting, KV blocks in use) and bounded sample
  windows for the latency percentiles, sorted again only when they changed since the last summary.

Clocks: ``mono`` orders one actor's events, ``wall`` compares actors. A duration between two
stamps of the same actor uses ``mono``; across actors (ARRIVED comes from the frontend, FIRST_TOKEN
from the scheduler) it uses ``wall``. Negative durations (clock skew) are clamped to zero.
"""

from __future__ import annotations

import contextlib
import enum
import heapq
import math
import os
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain, islice
from typing import Any

import msgspec
import structlog

from vllm_actors.actors.metrics_store.sequence_tracker import SequenceTracker, SeqVerdict
from vllm_actors.protocol.events import (
    Aborted,
    ActorCrashed,
    ActorDraining,
    ActorReady,
    ActorStarting,
    ActorStopped,
    Allocated,
    Arrived,
    BlockCached,
    BlockEvicted,
    Event,
    EventBatch,
    Finished,
    FirstToken,
    Freed,
    Heartbeat,
    KvPool,
    Preempted,
    PrefillChunk,
    PrefixHit,
    Queued,
    Resumed,
    Scheduled,
    StepFinished,
    StepStarted,
    Tokens,
    event_type,
)
from vllm_actors.protocol.names import CHILD_SEPARATOR, parent_request_id
from vllm_actors.protocol.metrics import (
    ActorSeen,
    DumpQuery,
    DumpReply,
    ErrorReply,
    EventsQuery,
    EventsReply,
    MetricsCodec,
    MetricsQuery,
    MetricsReply,
    Percentiles,
    SeenQuery,
    SeenReply,
    SummaryQuery,
    SummaryReply,
    TimelineEntry,
    TimelineQuery,
    TimelineReply,
    event_json_line,
)

log = structlog.get_logger(__name__)

MAX_EVENTS_PER_QUERY = 10_000
# Over-long timelines drop their high-volume entries first; the rest get this much more room.
_BULK_TYPES = (Allocated, PrefillChunk, BlockCached)
_TIMELINE_RESERVE = 256




# --------------------------------------------------------------------------- samples
class Samples:
    """Count, mean and max of every value; percentiles over the last ``window`` values (linear
    interpolation, as ``numpy.percentile``'s default), cached until the next value."""

    __slots__ = ("_cached", "_window", "count", "max", "total")

    def __init__(self, window: int) -> None:
        self._window: deque[float] = deque(maxlen=window)
        self._cached: Percentiles | None = Percentiles()
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self._window.append(value)
        self.total += value
        self.max = value if self.count == 0 else max(self.max, value)
        self.count += 1
        self._cached = None

    def extend(self, values: Iterable[float]) -> None:
        finite = [value for value in values if math.isfinite(value)]
        if not finite:
            return
        self._window.extend(finite)
        self.total += sum(finite)
        self.max = max(finite) if self.count == 0 else max(self.max, max(finite))
        self.count += len(finite)
        self._cached = None

    def percentiles(self) -> Percentiles:
        if self._cached is None:
            ordered = sorted(self._window)
            self._cached = Percentiles(
                count=self.count, mean=self.total / self.count, p50=_quantile(ordered, 0.50),
                p90=_quantile(ordered, 0.90), p99=_quantile(ordered, 0.99), max=self.max,
            )
        return self._cached


def _quantile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, interpolating linearly between the two nearest ranks."""
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


# --------------------------------------------------------------------------- per request
Stamp = tuple[str, float, float]  # (actor, mono, wall) of the batch an event came in
# (global index of the event, actor, seq, mono, wall, event)
_Entry = tuple[int, str, int, float, float, Event]


class _TokenLog:
    """A request's TOKENS entries, compact: a long generation makes thousands of them, and
    keeping the shared TOKENS events themselves would keep every request's ids alive."""

    __slots__ = ("actor", "count", "index", "mono", "seq", "step", "wall")

    def __init__(self) -> None:
        self.index = array("q")
        self.actor: list[str] = []
        self.seq = array("q")
        self.mono = array("d")
        self.wall = array("d")
        self.step = array("q")
        self.count = array("q")  # the request's output length after the step (-1: not given)

    def __len__(self) -> int:
        return len(self.index)

    def append(self, index: int, actor: str, seq: int, mono: float, wall: float, step: int, count: int) -> None:
        self.index.append(index)
        self.actor.append(actor)
        self.seq.append(seq)
        self.mono.append(mono)
        self.wall.append(wall)
        self.step.append(step)
        self.count.append(count)

    def entries(self, request_id: str) -> Iterator[_Entry]:
        for row in range(len(self.index)):
            count = self.count[row]
            event = Tokens(step_id=self.step[row], request_ids=[request_id],
                           num_output_tokens=[count] if count >= 0 else [])
            yield self.index[row], self.actor[row], self.seq[row], self.mono[row], self.wall[row], event


def elapsed(start: Stamp, end: Stamp) -> float:
    """Seconds from start to end: mono within one actor, wall across actors; never negative."""
    seconds = end[1] - start[1] if start[0] == end[0] else end[2] - start[2]
    return max(seconds, 0.0)


class RequestState(str, enum.Enum):
    NEW = "new"  # seen only through events that do not tell its state (joined late)
    ARRIVED = "arrived"
    WAITING = "waiting"
    RUNNING = "running"
    LOST = "lost"  # was live when the actor that scheduled it restarted
    FINISHED = "finished"
    ABORTED = "aborted"


_ENDED = (RequestState.FINISHED, RequestState.ABORTED)


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    entries: list[_Entry] = field(default_factory=list)  # every event but TOKENS
    tokens: _TokenLog = field(default_factory=_TokenLog)
    dropped: int = 0
    state: RequestState = RequestState.NEW
    owner: str | None = None  # the actor that last set WAITING / RUNNING
    arrived: Stamp | None = None
    queued: Stamp | None = None
    scheduled: Stamp | None = None
    first_token: Stamp | None = None
    last_token: Stamp | None = None
    num_output_tokens: int | None = None  # None: unknown (the store joined after its start)
    prompt_counted: bool = False
    itl: list[float] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.state in _ENDED

    @property
    def saw_start(self) -> bool:
        return self.arrived is not None or self.queued is not None


@dataclass(slots=True)
class _KvPool:
    """One KV-cache actor's pool: its latest KV_POOL state, and the blocks it handed out per
    request from its ALLOCATED / FREED events (the fallback when no state was seen)."""

    blocks: dict[str, int] = field(default_factory=dict)
    in_use: int = 0
    free: int | None = None  # num_free_blocks of its latest event
    state: KvPool | None = None


class _Counters(msgspec.Struct, kw_only=True):
    requests_arrived: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    finished_by_reason: dict[str, int] = {}
    aborted_by_reason: dict[str, int] = {}
    requests_lost: int = 0
    requests_evicted: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    prefill_chunks: int = 0
    steps: int = 0
    step_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_evicted: int = 0


# --------------------------------------------------------------------------- the store
class MetricsStore:
    """Records every event batch of the bus; answers ``MetricsQuery``s with ``MetricsReply``s."""

    def __init__(
        self,
        max_events: int = 100_000,
        max_finished_requests: int = 10_000,
        *,
        max_open_requests: int = 50_000,
        max_timeline_events: int = 2_048,
        sample_window: int = 10_000,
    ) -> None:
        for name, value in (("max_events", max_events), ("max_finished_requests", max_finished_requests),
                            ("max_open_requests", max_open_requests),
                            ("max_timeline_events", max_timeline_events), ("sample_window", sample_window)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.max_events = max_events
        self.max_finished_requests = max_finished_requests
        self.max_open_requests = max_open_requests
        self.max_timeline_events = max_timeline_events

        self._history: deque[tuple[str, int, float, float, Event]] = deque(maxlen=max_events)
        self._num_events = 0  # events applied so far: the global index of the next one
        self._num_batches = 0
        self._first_wall: float | None = None
        self._last_wall: float | None = None

        self._sequences = SequenceTracker()
        self._actors: dict[str, ActorSeen] = {}

        self._open: dict[str, _Request] = {}  # insertion order: oldest first
        self._ended: dict[str, _Request] = {}  # insertion order: oldest first
        self._children: dict[str, set[str]] = {}  # parent id -> child ids with a record
        self._running: set[str] = set()
        self._waiting: set[str] = set()
        self._kv: dict[str, _KvPool] = {}

        self._counters = _Counters()
        self._ttft = Samples(sample_window)
        self._itl = Samples(sample_window)
        self._e2e = Samples(sample_window)
        self._queue = Samples(sample_window)
        self._step_ms = Samples(sample_window)
        self._itl_cap = sample_window

        self._codec = MetricsCodec()
        self._handlers: dict[type, Callable[[str, int, float, float, Any], None]] = {
            Arrived: self._on_arrived,
            Queued: self._on_queued,
            Scheduled: self._on_admitted,
            Resumed: self._on_admitted,
            PrefillChunk: self._on_prefill_chunk,
            FirstToken: self._on_first_token,
            Tokens: self._on_tokens,
            Preempted: self._on_preempted,
            Finished: self._on_finished,
            Aborted: self._on_aborted,
            Allocated: self._on_allocated,
            Freed: self._on_freed,
            PrefixHit: self._on_request_block_event,
            BlockCached: self._on_request_block_event,
            BlockEvicted: self._on_block_evicted,
            KvPool: self._on_kv_pool,
            StepStarted: self._ignore,
            StepFinished: self._on_step_finished,
            ActorStarting: self._on_lifecycle,
            ActorReady: self._on_lifecycle,
            ActorDraining: self._on_lifecycle,
            ActorStopped: self._on_lifecycle,
            ActorCrashed: self._on_lifecycle,
            Heartbeat: self._on_heartbeat,
        }

    # ------------------------------------------------------------------ recording
    def record(self, batch: EventBatch) -> None:
        """Apply one batch from the bus (in the order the bus delivered it)."""
        actor = batch.actor
        seen = self._actors.get(actor)
        if seen is None:
            seen = self._actors[actor] = ActorSeen(first_wall=batch.wall)
        seen.num_batches += 1
        seen.last_wall = batch.wall
        self._num_batches += 1
        if self._first_wall is None:
            self._first_wall = batch.wall
        self._last_wall = batch.wall if self._last_wall is None else max(self._last_wall, batch.wall)

        check = self._sequences.check(batch)
        skip = check.skip
        if check.verdict is SeqVerdict.GAP:
            seen.gaps += 1
            seen.missed += check.missed
            log.warning("event gap", actor=actor, missed=check.missed, first_seq=batch.first_seq)
        elif check.verdict is SeqVerdict.STALE:
            seen.stale_batches += 1
            seen.stale_events += skip
            log.info("stale event batch", actor=actor, first_seq=batch.first_seq, skipped=skip)
        elif check.verdict is SeqVerdict.RESTART:
            seen.restarts += 1
            log.warning("actor restarted", actor=actor, first_seq=batch.first_seq)
            self._on_restart(actor)

        events = batch.events
        if skip >= len(events):
            return
        mono, wall = batch.mono, batch.wall
        for position in range(skip, len(events)):
            event = events[position]
            seq = batch.first_seq + position
            self._history.append((actor, seq, mono, wall, event))
            handler = self._handlers.get(type(event))
            if handler is not None:
                handler(actor, seq, mono, wall, event)
            self._num_events += 1
        seen.num_events += len(events) - skip
        seen.last_seq = batch.first_seq + len(events) - 1

    def _on_restart(self, actor: str) -> None:
        """A new incarnation of ``actor``: what it held is gone (its requests, its KV blocks)."""
        lost = [record for record in self._open.values()
                if record.owner == actor and record.state in (RequestState.WAITING, RequestState.RUNNING)]
        for record in lost:
            self._set_state(record, RequestState.LOST, actor)
        self._counters.requests_lost += len(lost)
        self._kv.pop(actor, None)

    # ------------------------------------------------------------------ request records
    def _find(self, request_id: str) -> _Request | None:
        record = self._open.get(request_id)
        return record if record is not None else self._ended.get(request_id)

    def _request(self, request_id: str) -> _Request:
        record = self._find(request_id)
        if record is None:
            record = self._open[request_id] = _Request(request_id)
            if CHILD_SEPARATOR in request_id:
                self._children.setdefault(parent_request_id(request_id), set()).add(request_id)
            if len(self._open) > self.max_open_requests:
                self._evict_open()
        return record

    def _evict_open(self) -> None:
        oldest = next(iter(self._open.values()))
        del self._open[oldest.request_id]
        self._running.discard(oldest.request_id)
        self._waiting.discard(oldest.request_id)
        self._forget_child(oldest.request_id)
        self._counters.requests_evicted += 1
        log.info("open request dropped", request_id=oldest.request_id, state=oldest.state.value)

    def _forget_child(self, request_id: str) -> None:
        if CHILD_SEPARATOR not in request_id:
            return
        parent = parent_request_id(request_id)
        children = self._children.get(parent)
        if children is not None:
            children.discard(request_id)
            if not children:
                del self._children[parent]

    def _add_entry(self, record: _Request, actor: str, seq: int, mono: float, wall: float, event: Event) -> None:
        size = len(record.entries)
        if size >= self.max_timeline_events and (
            isinstance(event, _BULK_TYPES) or size >= self.max_timeline_events + _TIMELINE_RESERVE
        ):
            record.dropped += 1
            return
        record.entries.append((self._num_events, actor, seq, mono, wall, event))

    def _set_state(self, record: _Request, state: RequestState, actor: str) -> None:
        request_id = record.request_id
        if record.state is RequestState.RUNNING:
            self._running.discard(request_id)
        elif record.state is RequestState.WAITING:
            self._waiting.discard(request_id)
        record.state = state
        record.owner = actor
        if state is RequestState.RUNNING:
            self._running.add(request_id)
        elif state is RequestState.WAITING:
            self._waiting.add(request_id)

    def _mark_running(self, record: _Request, actor: str) -> None:
        """Work on a request (a prefill chunk, a token) shows it running, whatever was missed."""
        if record.state is not RequestState.RUNNING and not record.ended:
            self._set_state(record, RequestState.RUNNING, actor)

    def _end(self, record: _Request, state: RequestState, actor: str) -> None:
        self._set_state(record, state, actor)
        if self._open.pop(record.request_id, None) is None:
            return
        self._ended[record.request_id] = record
        while len(self._ended) > self.max_finished_requests:
            oldest = next(iter(self._ended.values()))
            del self._ended[oldest.request_id]
            self._forget_child(oldest.request_id)

    # ------------------------------------------------------------------ request events
    def _on_arrived(self, actor: str, seq: int, mono: float, wall: float, event: Arrived) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        if record.arrived is None:
            record.arrived = (actor, mono, wall)
            self._counters.requests_arrived += 1
            if not record.prompt_counted:
                record.prompt_counted = True
                self._counters.prompt_tokens += max(event.num_prompt_tokens, 0)
        if record.state is RequestState.NEW:
            record.state = RequestState.ARRIVED

    def _on_queued(self, actor: str, seq: int, mono: float, wall: float, event: Queued) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        if record.queued is None:
            record.queued = (actor, mono, wall)
            if record.num_output_tokens is None:
                record.num_output_tokens = 0
        if not record.ended:
            self._set_state(record, RequestState.WAITING, actor)

    def _on_admitted(self, actor: str, seq: int, mono: float, wall: float, event: Scheduled | Resumed) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        if isinstance(event, Scheduled) and record.scheduled is None:
            record.scheduled = (actor, mono, wall)
        self._counters.prefix_cache_queries += max(event.num_query_tokens, 0)
        self._counters.prefix_cache_hits += max(event.num_cached_tokens, 0)
        if not record.ended:
            self._set_state(record, RequestState.RUNNING, actor)

    def _on_preempted(self, actor: str, seq: int, mono: float, wall: float, event: Preempted) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        self._counters.preemptions += 1
        self._counters.recomputed_tokens += max(event.num_computed_tokens, 0)
        if not record.ended:
            self._set_state(record, RequestState.WAITING, actor)

    def _on_prefill_chunk(self, actor: str, seq: int, mono: float, wall: float, event: PrefillChunk) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        self._counters.prefill_chunks += 1
        self._counters.prefill_tokens += max(event.num_tokens, 0)
        self._mark_running(record, actor)

    def _on_first_token(self, actor: str, seq: int, mono: float, wall: float, event: FirstToken) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        if record.first_token is None:
            record.first_token = (actor, mono, wall)
        self._mark_running(record, actor)

    def _on_tokens(self, actor: str, seq: int, mono: float, wall: float, event: Tokens) -> None:
        # The hot path (one entry per running request per step): kept flat on purpose.
        stamp = (actor, mono, wall)
        counts = event.num_output_tokens
        num_counts = len(counts)
        step, index, cap = event.step_id, self._num_events, self.max_timeline_events
        open_records, running = self._open, RequestState.RUNNING
        generated = 0
        for position, request_id in enumerate(event.request_ids):
            record = open_records.get(request_id) or self._request(request_id)
            count = counts[position] if position < num_counts else None
            if len(record.tokens) < cap:
                record.tokens.append(index, actor, seq, mono, wall, step, -1 if count is None or count < 0 else count)
            else:
                record.dropped += 1
            generated += self._new_tokens(record, count)
            if record.state in _ENDED:
                continue  # e.g. the frontend finished it on a stop string while this step ran
            if record.first_token is None and count == 1:
                record.first_token = stamp
            last = record.last_token
            if last is not None and len(record.itl) < self._itl_cap:
                seconds = mono - last[1] if last[0] == actor else wall - last[2]
                record.itl.append(seconds if seconds > 0.0 else 0.0)
            record.last_token = stamp
            if record.state is not running:
                self._set_state(record, running, actor)
        self._counters.generation_tokens += generated

    @staticmethod
    def _new_tokens(record: _Request, count: int | None) -> int:
        """Tokens a TOKENS entry adds: the growth of the request's output length."""
        if count is None:
            return 1
        previous = record.num_output_tokens
        if previous is None:  # joined late: the earlier outputs were never reported here
            record.num_output_tokens = count
            return 1
        if count <= previous:
            return 0
        record.num_output_tokens = count
        return count - previous

    def _on_finished(self, actor: str, seq: int, mono: float, wall: float, event: Finished) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        if record.ended:
            return
        counters = self._counters
        counters.requests_finished += 1
        counters.finished_by_reason[event.reason] = counters.finished_by_reason.get(event.reason, 0) + 1
        if not record.prompt_counted:
            record.prompt_counted = True
            counters.prompt_tokens += max(event.num_prompt_tokens, 0)
        self._record_latencies(record, (actor, mono, wall))
        self._end(record, RequestState.FINISHED, actor)

    def _record_latencies(self, record: _Request, finished: Stamp) -> None:
        start = record.arrived or record.queued
        if start is not None:
            self._e2e.add(elapsed(start, finished))
            if record.first_token is not None:
                self._ttft.add(elapsed(start, record.first_token))
        if record.queued is not None and record.scheduled is not None:
            self._queue.add(elapsed(record.queued, record.scheduled))
        self._itl.extend(record.itl)
        record.itl = []

    def _on_aborted(self, actor: str, seq: int, mono: float, wall: float, event: Aborted) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        if record.ended:
            return
        counters = self._counters
        counters.requests_aborted += 1
        counters.aborted_by_reason[event.reason] = counters.aborted_by_reason.get(event.reason, 0) + 1
        record.itl = []
        self._end(record, RequestState.ABORTED, actor)

    # ------------------------------------------------------------------ KV cache
    def _on_allocated(self, actor: str, seq: int, mono: float, wall: float, event: Allocated) -> None:
        record = self._request(event.request_id)
        self._add_entry(record, actor, seq, mono, wall, event)
        pool = self._kv.setdefault(actor, _KvPool())
        count = len(event.block_ids)
        pool.blocks[event.request_id] = pool.blocks.get(event.request_id, 0) + count
        pool.in_use += count
        pool.free = max(event.num_free_blocks, 0)

    def _on_freed(self, actor: str, seq: int, mono: float, wall: float, event: Freed) -> None:
        record = self._find(event.request_id)  # a FREED never opens a record: nothing to follow
        if record is not None:
            self._add_entry(record, actor, seq, mono, wall, event)
        pool = self._kv.setdefault(actor, _KvPool())
        held = pool.blocks.get(event.request_id, 0)
        count = min(max(event.num_blocks, 0), held)  # never below what we saw allocated
        if count >= held:
            pool.blocks.pop(event.request_id, None)
        else:
            pool.blocks[event.request_id] = held - count
        pool.in_use -= count
        pool.free = max(event.num_free_blocks, 0)

    def _on_request_block_event(self, actor: str, seq: int, mono: float, wall: float,
                                event: PrefixHit | BlockCached) -> None:
        """A cache event of one request goes on its timeline (it never opens a record)."""
        record = self._find(event.request_id)
        if record is not None:
            self._add_entry(record, actor, seq, mono, wall, event)

    def _on_block_evicted(self, actor: str, seq: int, mono: float, wall: float, event: BlockEvicted) -> None:
        self._counters.kv_blocks_evicted += len(event.block_ids)

    def _on_kv_pool(self, actor: str, seq: int, mono: float, wall: float, event: KvPool) -> None:
        self._kv.setdefault(actor, _KvPool()).state = event

    # ------------------------------------------------------------------ worker and lifecycle
    def _on_step_finished(self, actor: str, seq: int, mono: float, wall: float, event: StepFinished) -> None:
        self._counters.steps += 1
        self._counters.step_tokens += max(event.num_tokens, 0)
        self._step_ms.add(event.execute_ms)

    def _ignore(self, actor: str, seq: int, mono: float, wall: float, event: Event) -> None:
        pass

    def _on_lifecycle(self, actor: str, seq: int, mono: float, wall: float, event: Event) -> None:
        seen = self._actors[actor]
        seen.state = event_type(event)
        if isinstance(event, (ActorStarting, ActorReady)):
            seen.pid, seen.role = event.pid, event.role
        elif isinstance(event, ActorCrashed):
            seen.crashes += 1
            seen.error = event.error

    def _on_heartbeat(self, actor: str, seq: int, mono: float, wall: float, event: Heartbeat) -> None:
        seen = self._actors[actor]
        seen.last_heartbeat_wall = wall
        seen.pid = event.pid

    # ------------------------------------------------------------------ queries
    def query(self, query: MetricsQuery) -> MetricsReply:
        """Answer one query; never raises: a query it cannot answer gets an ``ErrorReply``."""
        try:
            if isinstance(query, SummaryQuery):
                return self.summary()
            if isinstance(query, TimelineQuery):
                return self._timeline(query)
            if isinstance(query, SeenQuery):
                return self._seen(query)
            if isinstance(query, EventsQuery):
                return self._events(query)
            if isinstance(query, DumpQuery):
                return self._dump(query)
            return ErrorReply(message=f"unknown query: {type(query).__name__}")
        except Exception as exc:  # a query must always get a reply
            log.exception("query failed", query=type(query).__name__)
            return ErrorReply(message=f"query failed: {type(exc).__name__}: {exc}")

    def handle(self, data: bytes | memoryview) -> bytes:
        """A query frame in, the reply frame out (msgpack): what the ZMQ shell serves."""
        try:
            query = self._codec.decode_query(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._codec.encode(ErrorReply(message=f"malformed query: {exc}"))
        return self._codec.encode(self.query(query))

    def summary(self) -> SummaryReply:
        counters = self._counters
        in_use = total = cached = 0
        for pool in self._kv.values():
            if pool.state is not None:
                in_use += pool.state.num_in_use
                total += pool.state.num_blocks
                cached += pool.state.num_cached
            else:
                in_use += pool.in_use
                total += max(pool.in_use + (pool.free or 0), pool.in_use)
        return SummaryReply(
            num_batches=self._num_batches,
            num_events=self._num_events,
            num_retained=len(self._history),
            first_wall=self._first_wall,
            last_wall=self._last_wall,
            requests_arrived=counters.requests_arrived,
            requests_finished=counters.requests_finished,
            requests_aborted=counters.requests_aborted,
            finished_by_reason=dict(counters.finished_by_reason),
            aborted_by_reason=dict(counters.aborted_by_reason),
            requests_lost=counters.requests_lost,
            requests_evicted=counters.requests_evicted,
            running=len(self._running),
            waiting=len(self._waiting),
            open_requests=len(self._open),
            prompt_tokens=counters.prompt_tokens,
            generation_tokens=counters.generation_tokens,
            prefill_tokens=counters.prefill_tokens,
            recomputed_tokens=counters.recomputed_tokens,
            preemptions=counters.preemptions,
            prefill_chunks=counters.prefill_chunks,
            steps=counters.steps,
            step_tokens=counters.step_tokens,
            kv_blocks_in_use=in_use,
            kv_blocks_total=total,
            kv_usage=in_use / total if total else 0.0,
            kv_blocks_cached=cached,
            kv_blocks_evicted=counters.kv_blocks_evicted,
            prefix_cache_queries=counters.prefix_cache_queries,
            prefix_cache_hits=counters.prefix_cache_hits,
            ttft=self._ttft.percentiles(),
            itl=self._itl.percentiles(),
            e2e=self._e2e.percentiles(),
            queue=self._queue.percentiles(),
            step_ms=self._step_ms.percentiles(),
            actors=self._actors_copy(),
        )

    def _actors_copy(self) -> dict[str, ActorSeen]:
        return {actor: msgspec.structs.replace(seen) for actor, seen in sorted(self._actors.items())}

    def _seen(self, query: SeenQuery) -> MetricsReply:
        if query.actor is None:
            return SeenReply(actors=self._actors_copy())
        if not isinstance(query.actor, str):
            return ErrorReply(message="SeenQuery.actor must be a string or None")
        seen = self._actors.get(query.actor)
        return SeenReply(actors={} if seen is None else {query.actor: msgspec.structs.replace(seen)})

    def _timeline(self, query: TimelineQuery) -> MetricsReply:
        request_id = query.request_id
        if not isinstance(request_id, str) or not request_id:
            return ErrorReply(message="TimelineQuery.request_id must be a non-empty string")
        records: list[_Request] = []
        own = self._find(request_id)
        if own is not None:
            records.append(own)
        if query.include_children:
            for child in sorted(self._children.get(request_id, ()), key=_child_order):
                record = self._find(child)
                if record is not None:
                    records.append(record)
        if not records:
            return TimelineReply(request_id=request_id, found=False)
        entries = sorted(
            (entry for record in records for entry in chain(record.entries, record.tokens.entries(record.request_id))),
            key=lambda entry: entry[0],
        )
        per_actor: dict[str, list[_Entry]] = {}
        for entry in entries:  # one actor's entries in the order applied: its sequence order
            per_actor.setdefault(entry[1], []).append(entry)
        merged = heapq.merge(*per_actor.values(), key=lambda entry: entry[4])  # across actors: by wall
        return TimelineReply(
            request_id=request_id,
            found=True,
            events=[TimelineEntry(actor=actor, seq=seq, mono=mono, wall=wall, type=event_type(event), event=event)
                    for _, actor, seq, mono, wall, event in merged],
            dropped=sum(record.dropped for record in records),
            state=own.state.value if own is not None else None,
        )

    def _events(self, query: EventsQuery) -> MetricsReply:
        since, limit = query.since_index, query.limit
        if not isinstance(since, int) or not isinstance(limit, int) or isinstance(limit, bool):
            return ErrorReply(message="EventsQuery.since_index and limit must be integers")
        if limit < 1:
            return ErrorReply(message=f"EventsQuery.limit must be at least 1, got {limit}")
        limit = min(limit, MAX_EVENTS_PER_QUERY)
        end = self._num_events
        oldest = end - len(self._history)
        start = max(end + since, 0) if since < 0 else min(since, end)
        missed = max(oldest - start, 0)
        start = max(start, oldest)
        rows = islice(self._history, start - oldest, start - oldest + limit)
        events = [TimelineEntry(actor=a, seq=s, mono=m, wall=w, type=event_type(e), event=e) for a, s, m, w, e in rows]
        return EventsReply(first_index=start, next_index=start + len(events), missed=missed, events=events)

    def _dump(self, query: DumpQuery) -> MetricsReply:
        path = query.path
        if not isinstance(path, str) or not path:
            return ErrorReply(message="DumpQuery.path must be a non-empty string")
        path = os.path.abspath(path)
        temporary = f"{path}.tmp-{os.getpid()}"
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                for actor, seq, mono, wall, event in self._history:
                    handle.write(event_json_line(actor, seq, mono, wall, event))
                    handle.write("\n")
            os.replace(temporary, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            return ErrorReply(message=f"cannot write {path}: {exc}")
        log.info("event log dumped", path=path, num_events=len(self._history))
        return DumpReply(path=path, num_events=len(self._history))

    # ------------------------------------------------------------------ introspection (tests, shells)
    @property
    def num_events(self) -> int:
        return self._num_events

    def request_state(self, request_id: str) -> RequestState | None:
        record = self._find(request_id)
        return None if record is None else record.state


def _child_order(request_id: str) -> tuple[int, str]:
    suffix = request_id.rsplit(CHILD_SEPARATOR, 1)[1]
    return (int(suffix), "") if suffix.isdigit() else (1 << 62, suffix)
