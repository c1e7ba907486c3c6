"""Recording event batches: the sequence check per actor, the bounded event log, and each event
applied to the request records, counters, latency samples and KV pools it concerns."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from vllm_actors.actors.metrics_store.aggregates import Buckets, Counters, KvPoolState, Latencies
from vllm_actors.actors.metrics_store.bounds import MAX_ID_CHARS, bounded, cap_id, count_into, event_bytes
from vllm_actors.actors.metrics_store.bubbles import PipelineBubbles
from vllm_actors.actors.metrics_store.event_log import EventLog
from vllm_actors.actors.metrics_store.notices import ActorRestarted, EventGap, Notice, StaleBatch
from vllm_actors.actors.metrics_store.records import RequestState
from vllm_actors.actors.metrics_store.request_events import RequestEvents
from vllm_actors.actors.metrics_store.request_table import RequestTable
from vllm_actors.actors.metrics_store.sequence_tracker import SequenceTracker, SeqVerdict
from vllm_actors.actors.metrics_store.trust import Rejections, client_may_publish
from vllm_actors.protocol.events import (
    Aborted,
    ActorCrashed,
    ActorDraining,
    ActorFailed,
    ActorReady,
    ActorStarting,
    ActorStopped,
    Allocated,
    Arrived,
    BlockCached,
    BlockEvicted,
    BlockOffloaded,
    BlockRestored,
    Event,
    EventBatch,
    Finished,
    FirstToken,
    Freed,
    GroupFailed,
    Heartbeat,
    KvPool,
    PipelineReset,
    Preempted,
    PrefillChunk,
    PrefixHit,
    Queued,
    Resumed,
    Routed,
    Scheduled,
    SleepChanged,
    StepFinished,
    StepStarted,
    StepTimed,
    Tokens,
    event_type,
)
from vllm_actors.protocol.events import ActorRestarted as ActorRestartedEvent
from vllm_actors.protocol.metrics import ITERATION_TOKENS_BUCKETS, ActorSeen
from vllm_actors.protocol.names import is_engine_actor

MAX_CLIENTS = 1_024  # clients (publishers that are no engine actor) remembered; the oldest go first


def _handshake(batch: EventBatch) -> bool:
    return all(isinstance(event, (ActorStarting, Heartbeat)) for event in batch.events)


class Recorder(RequestEvents):
    """Everything the store learns from the bus. ``record`` applies one batch; what it has to
    say about the stream (gaps, stale batches, restarts, dropped records) goes to ``notices``."""

    def __init__(self, *, max_events: int, max_finished_requests: int, max_open_requests: int,
                 max_timeline_events: int, sample_window: int, max_history_bytes: int,
                 max_request_bytes: int) -> None:
        self.notices: list[Notice] = []
        self.history = EventLog(max_events, max_history_bytes)
        self.num_events = 0  # events applied so far: the global index of the next one
        self.num_batches = 0
        self.first_wall: float | None = None
        self.last_wall: float | None = None

        self.sequences = SequenceTracker()
        self.actors: dict[str, ActorSeen] = {}
        self.requests = RequestTable(max_open_requests, max_finished_requests, max_timeline_events, self.notices,
                                     max_request_bytes)
        self._num_clients = 0
        self._event_bytes = 0  # the estimated size of the event being applied
        self.kv: dict[str, KvPoolState] = {}
        self.counters = Counters()
        self.sleep = SleepChanged(sleeping=False)  # the scheduler's last word on sleep mode
        self.latencies = Latencies(sample_window)
        self.iteration_tokens = Buckets(ITERATION_TOKENS_BUCKETS)
        self.bubbles = PipelineBubbles()  # each pipeline stage's share of the pipeline's time not busy
        self._itl_cap = sample_window

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
            Routed: self._on_routed,
            BlockCached: self._on_request_block_event,
            BlockEvicted: self._on_block_evicted,
            BlockOffloaded: self._on_block_offloaded,
            BlockRestored: self._on_block_restored,
            KvPool: self._on_kv_pool,
            StepStarted: self._ignore,
            StepFinished: self._on_step_finished,
            StepTimed: self._ignore,  # the benchmarks' chunk table reads it from the log
            ActorStarting: self._on_lifecycle,
            ActorReady: self._on_lifecycle,
            ActorDraining: self._on_lifecycle,
            ActorStopped: self._on_lifecycle,
            ActorCrashed: self._on_lifecycle,
            Heartbeat: self._on_heartbeat,
            ActorFailed: self._on_actor_failed,
            ActorRestartedEvent: self._on_actor_restarted,
            GroupFailed: self._on_group_failed,
            PipelineReset: self._on_pipeline_reset,
            SleepChanged: self._on_sleep_changed,
        }
        self._rejections = Rejections(self.notices)

    # ------------------------------------------------------------------ batches
    def record(self, batch: EventBatch, topic: str | None = None) -> None:
        """Apply one batch from the bus (in the order the bus delivered it). ``topic`` is the bus
        topic it came under (the bus vouches for it): a batch naming another actor is dropped."""
        actor = batch.actor
        if len(actor) > MAX_ID_CHARS:  # an id of no actor of ours: kept short, as request ids
            actor = cap_id(actor)
            batch = msgspec.structs.replace(batch, actor=actor)
        if topic is not None and len(topic) > MAX_ID_CHARS:
            topic = cap_id(topic)
        if topic is not None and topic != actor:
            self.counters.rejected_batches += 1
            self._rejections.count(topic, actor, "batch names another actor than its topic", 1)
            return
        seen = self.actors.get(actor)
        if seen is None:
            seen = self._new_actor(actor, batch.wall)
        seen.num_batches += 1
        seen.last_wall = batch.wall
        self.num_batches += 1
        if self.first_wall is None:
            self.first_wall = batch.wall
        self.last_wall = batch.wall if self.last_wall is None else max(self.last_wall, batch.wall)

        check = self.sequences.check(batch)
        skip = check.skip
        if check.verdict is SeqVerdict.FIRST and batch.first_seq > 0 and not _handshake(batch):
            # The actor published before this store saw it (the store restarted, or joined late).
            # Not when its first batch seen is a start-up handshake (STARTING, HEARTBEAT): those
            # are repeated until the store sees one, and the ones before were lost to the
            # subscription still on its way (PUB/SUB's slow joiner), not to a store restart.
            seen.gaps += 1
            seen.missed += batch.first_seq
            self.notices.append(EventGap(actor=actor, missed=batch.first_seq, first_seq=batch.first_seq))
        elif check.verdict is SeqVerdict.GAP:
            seen.gaps += 1
            seen.missed += check.missed
            self.notices.append(EventGap(actor=actor, missed=check.missed, first_seq=batch.first_seq))
        elif check.verdict is SeqVerdict.STALE and not (_handshake(batch) and check.skip == len(batch.events)):
            # (a start-up handshake is resent until the store sees it: a late copy is expected, not stale)
            seen.stale_batches += 1
            seen.stale_events += skip
            self.notices.append(StaleBatch(actor=actor, first_seq=batch.first_seq, skipped=skip))
        elif check.verdict is SeqVerdict.RESTART:
            seen.restarts += 1
            self.notices.append(ActorRestarted(actor=actor, first_seq=batch.first_seq))
            self._on_restart(actor)

        events = batch.events
        if skip >= len(events):
            return
        mono, wall = batch.mono, batch.wall
        client = not is_engine_actor(actor)
        applied = 0
        for position in range(skip, len(events)):
            event = events[position]
            if client and not client_may_publish(event):
                seen.rejected_events += 1
                self.counters.rejected_events += 1
                self._rejections.count(actor, actor, f"a client may not publish {event_type(event)}", 1)
                continue
            seq = batch.first_seq + position
            event = bounded(event)
            self._event_bytes = size = event_bytes(event)
            self.history.append((actor, seq, mono, wall, event), size)
            handler = self._handlers.get(type(event))
            if handler is not None:
                handler(actor, seq, mono, wall, event)
            self.num_events += 1
            applied += 1
        seen.num_events += applied
        seen.last_seq = batch.first_seq + len(events) - 1
        self.requests.trim()

    def _new_actor(self, actor: str, wall: float) -> ActorSeen:
        """An actor's first batch: remembered; past ``MAX_CLIENTS`` clients the oldest is forgotten."""
        if not is_engine_actor(actor):
            self._num_clients += 1
            if self._num_clients > MAX_CLIENTS:
                oldest = next(name for name in self.actors if not is_engine_actor(name))
                del self.actors[oldest]
                self.sequences.forget(oldest)
                self._num_clients -= 1
        seen = self.actors[actor] = ActorSeen(first_wall=wall)
        return seen

    def _on_restart(self, actor: str) -> None:
        """A new incarnation of ``actor``: what it held is gone (its requests, its KV blocks). Its
        requests are interrupted, not lost: their frontend resubmits them and most finish."""
        interrupted = self.requests.owned_by(actor)
        for record in interrupted:
            self.requests.set_state(record, RequestState.LOST, actor)
            record.interrupted = True
        self.counters.requests_interrupted += len(interrupted)
        self.kv.pop(actor, None)

    # ------------------------------------------------------------------ KV cache
    def _on_allocated(self, actor: str, seq: int, mono: float, wall: float, event: Allocated) -> None:
        self._entry(event.request_id, actor, seq, mono, wall, event)
        pool = self.kv.setdefault(actor, KvPoolState())
        pool.allocated(event.request_id, len(event.block_ids), event.num_free_blocks)

    def _on_freed(self, actor: str, seq: int, mono: float, wall: float, event: Freed) -> None:
        self._on_request_block_event(actor, seq, mono, wall, event)  # a FREED never opens a record
        self.kv.setdefault(actor, KvPoolState()).freed(event.request_id, event.num_blocks, event.num_free_blocks)

    def _on_request_block_event(self, actor: str, seq: int, mono: float, wall: float,
                                event: PrefixHit | BlockCached | Freed) -> None:
        """A cache event of one request goes on its timeline (it never opens a record)."""
        record = self.requests.find(event.request_id)
        if record is not None:
            self.requests.add_entry(record, self.num_events, actor, seq, mono, wall, event, self._event_bytes)

    def _on_block_evicted(self, actor: str, seq: int, mono: float, wall: float, event: BlockEvicted) -> None:
        self.counters.kv_blocks_evicted += len(event.block_ids)

    def _on_block_offloaded(self, actor: str, seq: int, mono: float, wall: float, event: BlockOffloaded) -> None:
        self.counters.kv_blocks_offloaded += event.num_blocks

    def _on_block_restored(self, actor: str, seq: int, mono: float, wall: float, event: BlockRestored) -> None:
        self.counters.kv_blocks_restored += event.num_blocks

    def _on_kv_pool(self, actor: str, seq: int, mono: float, wall: float, event: KvPool) -> None:
        self.kv.setdefault(actor, KvPoolState()).state = event

    # ------------------------------------------------------------------ worker and lifecycle
    def _on_step_finished(self, actor: str, seq: int, mono: float, wall: float, event: StepFinished) -> None:
        self.bubbles.step(actor, wall, event)
        if event.stage is not None:  # an earlier pipeline stage's part: the last stage's event counts the step
            return
        self.counters.steps += 1
        self.counters.step_tokens += max(event.num_tokens, 0)
        self.counters.drained_steps += event.drained
        self.latencies.step_ms.add(event.execute_ms)
        if event.num_drafts:
            self.counters.spec_decode.add(event.num_drafts, event.num_draft_tokens, event.num_accepted_tokens,
                                          event.accepted_per_pos)

    def _ignore(self, actor: str, seq: int, mono: float, wall: float, event: Event) -> None:
        pass

    def _on_lifecycle(self, actor: str, seq: int, mono: float, wall: float, event: Event) -> None:
        seen = self.actors[actor]
        seen.state = event_type(event)
        if isinstance(event, (ActorStarting, ActorReady)):
            seen.pid, seen.role = event.pid, event.role
        elif isinstance(event, ActorCrashed):
            seen.crashes += 1
            seen.error = event.error

    def _on_actor_failed(self, actor: str, seq: int, mono: float, wall: float, event: ActorFailed) -> None:
        count_into(self.counters.actor_failures, event.actor)

    def _on_actor_restarted(self, actor: str, seq: int, mono: float, wall: float, event: ActorRestartedEvent) -> None:
        count_into(self.counters.actor_restarts, event.actor)
        self.latencies.restart.add(event.seconds)

    def _on_group_failed(self, actor: str, seq: int, mono: float, wall: float, event: GroupFailed) -> None:
        """The group is gone for good: every open request is answered with an error (lost)."""
        self.counters.group_failed = event.reason
        for record in list(self.requests.open.values()):
            if not record.lost:
                record.lost = True
                self.counters.requests_lost += 1
                self.requests.set_state(record, RequestState.LOST, actor)

    def _on_pipeline_reset(self, actor: str, seq: int, mono: float, wall: float, event: PipelineReset) -> None:
        self.counters.pipeline_resets += 1

    def _on_sleep_changed(self, actor: str, seq: int, mono: float, wall: float, event: SleepChanged) -> None:
        self.sleep = event

    def _on_heartbeat(self, actor: str, seq: int, mono: float, wall: float, event: Heartbeat) -> None:
        seen = self.actors[actor]
        seen.last_heartbeat_wall = wall
        seen.pid = event.pid

