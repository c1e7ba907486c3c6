"""The metrics store's state machine: timelines, gauges, counters, percentiles, gaps, bounds, dumps."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Sequence
from itertools import pairwise
from pathlib import Path

import msgspec
import numpy as np
import pytest
import structlog
import structlog.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_actors.actors.metrics_store.aggregates import Samples
from vllm_actors.actors.metrics_store.dump import DumpContent
from vllm_actors.actors.metrics_store.notices import ActorRestarted, EventGap, Notice, OpenRequestDropped, StaleBatch
from vllm_actors.actors.metrics_store.records import RequestState, elapsed
from vllm_actors.actors.metrics_store.sequence_tracker import SequenceTracker, SeqVerdict
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.observe.stats_text import summary_text
from vllm_actors.observe.tap import save_dump
from vllm_actors.protocol.events import (
    Aborted,
    ActorCrashed,
    ActorReady,
    ActorStarting,
    Allocated,
    Arrived,
    Event,
    EventBatch,
    Finished,
    FirstToken,
    Freed,
    Heartbeat,
    Preempted,
    PrefillChunk,
    Queued,
    Resumed,
    Scheduled,
    StepFinished,
    StepStarted,
    Tokens,
    event_type,
)
from vllm_actors.protocol.metrics import (
    DumpQuery,
    DumpReply,
    ErrorReply,
    EventsQuery,
    EventsReply,
    MetricsCodec,
    Percentiles,
    SeenQuery,
    SeenReply,
    SummaryQuery,
    SummaryReply,
    TimelineQuery,
    TimelineReply,
    parse_event_json_line,
)
from vllm_actors.runtime.metrics_shell import answer, answer_frame, record_logged

FRONTEND, SCHEDULER, KV, WORKER = "frontend", "scheduler", "kv_cache_manager", "worker-0"
WALL0 = 1_700_000_000.0
# Each actor's monotonic clock has its own origin: a store that compared mono across actors
# would be off by seconds.
MONO_OFFSET = {FRONTEND: 10.0, SCHEDULER: 250.0, KV: 4000.0, WORKER: 77.0}
TOTAL_BLOCKS = 64


class Bus:
    """Stamps batches like the actor shells do: per-actor sequence numbers, a shared fake clock."""

    def __init__(self, store: MetricsStore | None = None) -> None:
        self.store = store
        self.now = 0.0
        self.next_seq: dict[str, int] = {}
        self.batches: list[EventBatch] = []
        self.notices: list[Notice] = []  # what the store said about the delivered batches

    def publish(self, actor: str, *events: Event, at: float | None = None, deliver: bool = True) -> EventBatch:
        if at is not None:
            self.now = at
        seq = self.next_seq.get(actor, 0)
        self.next_seq[actor] = seq + len(events)
        batch = EventBatch(actor=actor, first_seq=seq, mono=MONO_OFFSET.get(actor, 0.0) + self.now,
                           wall=WALL0 + self.now, events=list(events))
        self.batches.append(batch)
        if deliver and self.store is not None:
            self.notices.extend(self.store.record(batch))
        return batch

    def tick(self, seconds: float = 0.01) -> None:
        self.now += seconds


def summary(store: MetricsStore) -> SummaryReply:
    reply = store.query(SummaryQuery())
    assert isinstance(reply, SummaryReply)
    return reply


def timeline(store: MetricsStore, request_id: str, include_children: bool = True) -> TimelineReply:
    reply = store.query(TimelineQuery(request_id=request_id, include_children=include_children))
    assert isinstance(reply, TimelineReply)
    return reply


def assert_gauges_sane(reply: SummaryReply) -> None:
    for name in ("running", "waiting", "open_requests", "kv_blocks_in_use", "kv_blocks_total", "prompt_tokens",
                 "generation_tokens", "recomputed_tokens", "prefill_tokens"):
        assert getattr(reply, name) >= 0, name
    assert reply.kv_blocks_in_use <= reply.kv_blocks_total
    assert 0.0 <= reply.kv_usage <= 1.0


# --------------------------------------------------------------------------- a scripted scenario
class KvModel:
    """The KV-cache manager's bookkeeping, enough to publish consistent ALLOCATED / FREED."""

    def __init__(self, bus: Bus) -> None:
        self.bus, self.free, self.next_block = bus, TOTAL_BLOCKS, 0
        self.tables: dict[str, int] = {}

    def allocate(self, request_id: str, count: int) -> None:
        ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        self.free -= count
        self.tables[request_id] = self.tables.get(request_id, 0) + count
        self.bus.publish(KV, Allocated(request_id=request_id, block_ids=ids, num_free_blocks=self.free))

    def free_request(self, request_id: str) -> None:
        count = self.tables.pop(request_id)
        self.free += count
        self.bus.publish(KV, Freed(request_id=request_id, num_blocks=count, num_free_blocks=self.free))


def run_scenario(store: MetricsStore) -> Bus:
    """Six requests: chunked prefill, a preemption and resumption, n=2 children (one stopped by the
    frontend on a stop string), an abort while waiting, an admission error; and worker steps."""
    bus = Bus(store)
    kv = KvModel(bus)
    for actor in (FRONTEND, SCHEDULER, KV, WORKER):
        bus.publish(actor, ActorStarting(pid=100, role=actor), ActorReady(pid=100, role=actor))
    # arrivals
    bus.tick()
    for request_id, prompt in (("r1", 40), ("r2", 8), ("p#0", 6), ("p#1", 6), ("r3", 5), ("r4", 9999)):
        bus.publish(FRONTEND, Arrived(request_id=request_id, num_prompt_tokens=prompt, max_tokens=3))
    bus.tick()
    queued = ("r1", "r2", "p#0", "p#1", "r3")
    bus.publish(SCHEDULER, *(Queued(request_id=rid, num_waiting=i + 1) for i, rid in enumerate(queued)),
                Aborted(request_id="r4", reason="error"))
    # step 0: r1 first chunk (32 of 40), r2 whole prompt
    bus.tick()
    bus.publish(SCHEDULER, Scheduled(request_id="r1", step_id=0), Scheduled(request_id="r2", step_id=0),
                PrefillChunk(request_id="r1", step_id=0, start=0, num_tokens=32, last=False),
                PrefillChunk(request_id="r2", step_id=0, start=0, num_tokens=8, last=True))
    kv.allocate("r1", 2)
    kv.allocate("r2", 1)
    bus.publish(WORKER, StepStarted(step_id=0, num_seqs=2, num_tokens=40, num_prefill_seqs=2))
    bus.tick(0.02)
    bus.publish(WORKER, StepFinished(step_id=0, num_seqs=2, num_tokens=40, num_sampled=1, execute_ms=20.0))
    bus.publish(SCHEDULER, FirstToken(request_id="r2", step_id=0),
                Tokens(step_id=0, request_ids=["r2"], num_output_tokens=[1]))
    # step 1: r1 last chunk; r2 decodes; children admitted; r2 preempted to make room
    bus.tick()
    bus.publish(SCHEDULER, PrefillChunk(request_id="r1", step_id=1, start=32, num_tokens=8, last=True),
                Scheduled(request_id="p#0", step_id=1), Scheduled(request_id="p#1", step_id=1),
                PrefillChunk(request_id="p#0", step_id=1, start=0, num_tokens=6, last=True),
                PrefillChunk(request_id="p#1", step_id=1, start=0, num_tokens=6, last=True),
                Preempted(request_id="r2", step_id=1, num_computed_tokens=9))
    kv.free_request("r2")
    kv.allocate("r1", 1)
    kv.allocate("p#0", 1)
    kv.allocate("p#1", 1)
    bus.tick(0.03)
    bus.publish(WORKER, StepFinished(step_id=1, num_seqs=3, num_tokens=20, num_sampled=3, execute_ms=30.0))
    bus.publish(SCHEDULER, *(FirstToken(request_id=rid, step_id=1) for rid in ("r1", "p#0", "p#1")),
                Tokens(step_id=1, request_ids=["r1", "p#0", "p#1"], num_output_tokens=[1, 1, 1]))
    # the frontend meets a stop string in p#1's text: FINISHED from the frontend
    bus.tick()
    bus.publish(FRONTEND, Finished(request_id="p#1", reason="stop", num_prompt_tokens=6, num_output_tokens=1,
                                   stop_reason="\n\n"))
    # step 2: r2 resumed (recomputed), r3 aborted by the client while waiting
    bus.publish(FRONTEND, Aborted(request_id="r3", reason="abort"))
    bus.publish(SCHEDULER, Aborted(request_id="r3", reason="abort"), Resumed(request_id="r2", step_id=2),
                PrefillChunk(request_id="r2", step_id=2, start=0, num_tokens=9, last=True))
    kv.free_request("p#1")
    kv.allocate("r2", 1)
    bus.tick(0.025)
    bus.publish(WORKER, StepFinished(step_id=2, num_seqs=4, num_tokens=12, num_sampled=4, execute_ms=25.0))
    # the step ran before the abort of p#1 reached the scheduler: a straggling token for it
    bus.publish(SCHEDULER, Tokens(step_id=2, request_ids=["r1", "p#0", "p#1", "r2"], num_output_tokens=[2, 2, 2, 2]))
    # step 3: everyone finishes
    bus.tick(0.02)
    bus.publish(WORKER, StepFinished(step_id=3, num_seqs=3, num_tokens=3, num_sampled=3, execute_ms=10.0))
    bus.publish(SCHEDULER, Tokens(step_id=3, request_ids=["r1", "p#0", "r2"], num_output_tokens=[3, 3, 3]),
                Finished(request_id="r1", reason="length", num_prompt_tokens=40, num_output_tokens=3),
                Finished(request_id="p#0", reason="length", num_prompt_tokens=6, num_output_tokens=3),
                Finished(request_id="r2", reason="stop", num_prompt_tokens=8, num_output_tokens=3, stop_reason=2))
    bus.tick()
    for rid in ("r1", "p#0", "r2"):
        kv.free_request(rid)
    bus.publish(SCHEDULER, Heartbeat(pid=100))
    return bus


def test_scenario_counters_and_gauges_return_to_zero() -> None:
    store = MetricsStore()
    bus = run_scenario(store)
    reply = summary(store)
    assert reply.requests_arrived == 6
    assert reply.requests_finished == 4
    assert reply.finished_by_reason == {"length": 2, "stop": 2}
    assert reply.requests_aborted == 2  # r3 counted once although frontend and scheduler both said so
    assert reply.aborted_by_reason == {"abort": 1, "error": 1}
    assert (reply.running, reply.waiting, reply.open_requests) == (0, 0, 0)
    assert reply.kv_blocks_in_use == 0
    assert reply.kv_blocks_total == TOTAL_BLOCKS
    assert reply.kv_usage == 0.0
    assert reply.prompt_tokens == 40 + 8 + 6 + 6 + 5 + 9999
    # r1 3, p#0 3, r2 3, p#1 2 (its straggling token is still a generated token)
    assert reply.generation_tokens == 11
    assert reply.prefill_tokens == 32 + 8 + 8 + 6 + 6 + 9
    assert reply.recomputed_tokens == 9
    assert reply.preemptions == 1
    assert reply.prefill_chunks == 6
    assert reply.steps == 4
    assert reply.step_tokens == 40 + 20 + 12 + 3
    assert reply.num_events == sum(len(batch.events) for batch in bus.batches)
    assert reply.num_batches == len(bus.batches)
    assert reply.step_ms.count == 4 and reply.step_ms.mean == pytest.approx(21.25)
    assert reply.step_ms.max == 30.0
    assert set(reply.actors) == {FRONTEND, SCHEDULER, KV, WORKER}
    assert all(seen.state == "READY" and seen.gaps == 0 for seen in reply.actors.values())
    assert reply.actors[SCHEDULER].last_heartbeat_wall == pytest.approx(WALL0 + bus.now)
    assert reply.actors[SCHEDULER].last_seq == bus.next_seq[SCHEDULER] - 1
    assert store.request_state("p#1") is RequestState.FINISHED  # the straggler did not revive it


def test_scenario_gauges_mid_stream() -> None:
    store = MetricsStore()
    bus = Bus(store)
    bus.publish(FRONTEND, Arrived(request_id="a", num_prompt_tokens=4, max_tokens=4),
                Arrived(request_id="b", num_prompt_tokens=4, max_tokens=4))
    assert (summary(store).running, summary(store).waiting) == (0, 0)
    bus.publish(SCHEDULER, Queued(request_id="a", num_waiting=1), Queued(request_id="b", num_waiting=2))
    assert (summary(store).running, summary(store).waiting) == (0, 2)
    bus.publish(SCHEDULER, Scheduled(request_id="a", step_id=0))
    bus.publish(KV, Allocated(request_id="a", block_ids=[0, 1, 2], num_free_blocks=5))
    reply = summary(store)
    assert (reply.running, reply.waiting, reply.kv_blocks_in_use, reply.kv_blocks_total) == (1, 1, 3, 8)
    assert reply.kv_usage == pytest.approx(3 / 8)
    bus.publish(SCHEDULER, Scheduled(request_id="b", step_id=1),
                Preempted(request_id="a", step_id=1, num_computed_tokens=4))
    bus.publish(KV, Freed(request_id="a", num_blocks=3, num_free_blocks=8),
                Allocated(request_id="b", block_ids=[7], num_free_blocks=7))
    reply = summary(store)
    assert (reply.running, reply.waiting, reply.kv_blocks_in_use) == (1, 1, 1)
    bus.publish(SCHEDULER, Aborted(request_id="a", reason="disconnect"))
    assert (summary(store).running, summary(store).waiting) == (1, 0)


def _tokens_of(event: Event, request_id: str) -> Event:
    if isinstance(event, Tokens):
        index = event.request_ids.index(request_id)
        return Tokens(step_id=event.step_id, request_ids=[request_id],
                      num_output_tokens=[event.num_output_tokens[index]])
    return event


def _concerns(event: Event, request_id: str) -> bool:
    if isinstance(event, Tokens):
        return request_id in event.request_ids
    return getattr(event, "request_id", None) == request_id


def expected_timeline(batches: Iterable[EventBatch], request_id: str) -> dict[str, list[tuple[int, Event]]]:
    per_actor: dict[str, list[tuple[int, Event]]] = {}
    for batch in batches:
        for index, event in enumerate(batch.events):
            if _concerns(event, request_id):
                per_actor.setdefault(batch.actor, []).append((batch.first_seq + index, _tokens_of(event, request_id)))
    return per_actor


def test_scenario_timelines_complete_and_ordered() -> None:
    store = MetricsStore()
    bus = run_scenario(store)
    for request_id in ("r1", "r2", "p#0", "p#1", "r3", "r4"):
        reply = timeline(store, request_id)
        assert reply.found and reply.dropped == 0
        got: dict[str, list[tuple[int, Event]]] = {}
        for entry in reply.events:
            assert entry.type == event_type(entry.event)
            got.setdefault(entry.actor, []).append((entry.seq, entry.event))
        assert got == expected_timeline(bus.batches, request_id), request_id
        walls = [entry.wall for entry in reply.events]
        assert walls == sorted(walls)  # across actors merged by wall clock
    r2 = [entry.type for entry in timeline(store, "r2").events]
    assert r2 == ["ARRIVED", "QUEUED", "SCHEDULED", "PREFILL_CHUNK", "ALLOCATED", "FIRST_TOKEN", "TOKENS",
                  "PREEMPTED", "FREED", "RESUMED", "PREFILL_CHUNK", "ALLOCATED", "TOKENS", "TOKENS", "FINISHED",
                  "FREED"]
    assert timeline(store, "r2").state == "finished"
    assert timeline(store, "r3").state == "aborted"
    # the parent id gathers its children's events; a child id alone gives only its own
    parent = timeline(store, "p")
    assert parent.found and parent.state is None
    owners = {entry.event.request_ids[0] if isinstance(entry.event, Tokens)
              else entry.event.request_id  # type: ignore[union-attr]
              for entry in parent.events}
    assert owners == {"p#0", "p#1"}
    assert len(parent.events) == len(timeline(store, "p#0").events) + len(timeline(store, "p#1").events)
    assert not timeline(store, "p", include_children=False).found
    assert not timeline(store, "nope").found


# --------------------------------------------------------------------------- latencies
def simulate_latencies(store: MetricsStore, num_requests: int, seed: int) -> dict[str, list[float]]:
    """Requests with random timings, each event published at its own time; returns the ground truth."""
    rng = random.Random(seed)
    timed: list[tuple[float, int, str, Event]] = []
    truth: dict[str, list[float]] = {"ttft": [], "itl": [], "e2e": [], "queue": []}
    order = 0
    for index in range(num_requests):
        rid = f"req-{index}"
        arrive = rng.uniform(0, 50)
        queued = arrive + rng.uniform(0.0005, 0.005)
        scheduled = queued + rng.expovariate(10)
        first = scheduled + rng.uniform(0.01, 0.3)
        token_times = [first]
        for _ in range(rng.randint(0, 12)):
            token_times.append(token_times[-1] + rng.uniform(0.005, 0.08))
        finish = token_times[-1]
        events: list[tuple[float, str, Event]] = [
            (arrive, FRONTEND, Arrived(request_id=rid, num_prompt_tokens=10, max_tokens=20)),
            (queued, SCHEDULER, Queued(request_id=rid, num_waiting=1)),
            (scheduled, SCHEDULER, Scheduled(request_id=rid, step_id=index)),
            (first, SCHEDULER, FirstToken(request_id=rid, step_id=index)),
        ]
        events += [(t, SCHEDULER, Tokens(step_id=index, request_ids=[rid], num_output_tokens=[n + 1]))
                   for n, t in enumerate(token_times)]
        events.append((finish, SCHEDULER, Finished(request_id=rid, reason="length", num_prompt_tokens=10,
                                                   num_output_tokens=len(token_times))))
        for t, actor, event in events:
            timed.append((t, order, actor, event))
            order += 1
        truth["ttft"].append(first - arrive)
        truth["itl"] += [later - earlier for earlier, later in pairwise(token_times)]
        truth["e2e"].append(finish - arrive)
        truth["queue"].append(scheduled - queued)
    bus = Bus(store)
    for t, _, actor, event in sorted(timed):
        bus.publish(actor, event, at=t)
    return truth


def assert_percentiles(got: Percentiles, values: Sequence[float]) -> None:
    assert got.count == len(values)
    assert got.mean == pytest.approx(statistics.fmean(values), abs=1e-6)  # wall clocks near 1.7e9: ~0.2 µs
    assert got.max == pytest.approx(max(values), abs=1e-6)
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
        assert getattr(got, name) == pytest.approx(cuts[q - 1], abs=1e-6), name
        assert getattr(got, name) == pytest.approx(float(np.percentile(values, q)), abs=1e-6), name


def test_latency_percentiles_match_direct_computation() -> None:
    store = MetricsStore()
    truth = simulate_latencies(store, num_requests=300, seed=1234)
    reply = summary(store)
    assert reply.requests_finished == 300
    for name in ("ttft", "itl", "e2e", "queue"):
        assert_percentiles(getattr(reply, name), truth[name])


def test_percentile_window_is_bounded_but_count_and_mean_are_not() -> None:
    samples = Samples(window=100)
    values = [float(v) for v in range(1000)]
    samples.extend(values)
    samples.add(float("nan"))  # ignored
    got = samples.percentiles()
    assert got.count == 1000 and got.mean == pytest.approx(statistics.fmean(values)) and got.max == 999.0
    assert got.p50 == pytest.approx(float(np.percentile(values[-100:], 50)))
    assert Samples(window=5).percentiles() == Percentiles()


def test_durations_use_mono_within_an_actor_and_wall_across() -> None:
    assert elapsed(("a", 10.0, 1000.0), ("a", 10.5, 5000.0)) == 0.5
    assert elapsed(("a", 10.0, 1000.0), ("b", 99.0, 1000.25)) == 0.25
    assert elapsed(("a", 10.0, 1000.0), ("b", 99.0, 999.0)) == 0.0  # skew clamped


def test_late_joined_store_uses_queued_as_start() -> None:
    store = MetricsStore()
    bus = Bus(store)
    bus.publish(SCHEDULER, Queued(request_id="x", num_waiting=1), at=1.0)
    bus.publish(SCHEDULER, Scheduled(request_id="x", step_id=0), at=1.5)
    bus.publish(SCHEDULER, FirstToken(request_id="x", step_id=0),
                Tokens(step_id=0, request_ids=["x"], num_output_tokens=[1]), at=2.0)
    bus.publish(SCHEDULER, Finished(request_id="x", reason="stop", num_prompt_tokens=7, num_output_tokens=1), at=2.0)
    # a request already running when the store joined: no start, no latencies, but counted
    bus.publish(SCHEDULER, Tokens(step_id=5, request_ids=["y"], num_output_tokens=[40]), at=3.0)
    assert summary(store).running == 1
    bus.publish(SCHEDULER, Tokens(step_id=6, request_ids=["y"], num_output_tokens=[41]),
                Finished(request_id="y", reason="length", num_prompt_tokens=3, num_output_tokens=41), at=3.5)
    reply = summary(store)
    assert reply.ttft.count == 1 and reply.ttft.mean == pytest.approx(1.0)
    assert reply.e2e.count == 1 and reply.queue.mean == pytest.approx(0.5)
    assert reply.itl.count == 1 and reply.itl.mean == pytest.approx(0.5)  # y's two tokens
    assert reply.requests_arrived == 0 and reply.requests_finished == 2
    assert reply.prompt_tokens == 10  # from FINISHED when ARRIVED was never seen
    assert reply.generation_tokens == 3  # x 1, y 1 + 1 (its earlier outputs were never reported here)
    assert (reply.running, reply.open_requests) == (0, 0)


# --------------------------------------------------------------------------- sequence numbers
def test_gap_counting_and_lost_batch() -> None:
    store = MetricsStore()
    bus = Bus(store)
    bus.publish(SCHEDULER, Queued(request_id="a", num_waiting=1), Queued(request_id="b", num_waiting=2))
    lost = bus.publish(SCHEDULER, Scheduled(request_id="a", step_id=0), Scheduled(request_id="b", step_id=0),
                       Aborted(request_id="b", reason="abort"), deliver=False)
    bus.publish(SCHEDULER, Tokens(step_id=0, request_ids=["a"], num_output_tokens=[1]))
    bus.publish(SCHEDULER, Finished(request_id="a", reason="stop", num_prompt_tokens=1, num_output_tokens=1))
    seen = store.query(SeenQuery(actor=SCHEDULER))
    assert isinstance(seen, SeenReply)
    info = seen.actors[SCHEDULER]
    assert (info.gaps, info.missed, info.num_events, info.last_seq) == (1, len(lost.events), 4, 6)
    assert bus.notices == [EventGap(actor=SCHEDULER, missed=len(lost.events), first_seq=5)]  # for the shell's log
    reply = summary(store)
    assert_gauges_sane(reply)
    assert reply.running == 0
    assert reply.waiting == 1  # b's admission and abort were lost: it still looks queued
    assert store.query(SeenQuery(actor="nobody")) == SeenReply(actors={})


def test_first_batch_sets_baseline_and_stale_batches_are_skipped() -> None:
    store = MetricsStore()
    batch = EventBatch(actor=SCHEDULER, first_seq=500, mono=1.0, wall=WALL0, events=[
        Queued(request_id="a", num_waiting=1), Queued(request_id="b", num_waiting=2)])
    # a store that restarted (or joined late) never saw events 0..499: one gap, not silence
    assert store.record(batch) == [EventGap(actor=SCHEDULER, missed=500, first_seq=500)]
    assert store.record(batch) == [StaleBatch(actor=SCHEDULER, first_seq=500, skipped=2)]  # a duplicate
    overlap = EventBatch(actor=SCHEDULER, first_seq=501, mono=1.0, wall=WALL0, events=[
        Queued(request_id="b", num_waiting=2), Queued(request_id="c", num_waiting=3)])
    # its first event was seen already, its second is new
    assert store.record(overlap) == [StaleBatch(actor=SCHEDULER, first_seq=501, skipped=1)]
    info = store.query(SeenQuery()).actors[SCHEDULER]  # type: ignore[union-attr]
    assert (info.gaps, info.missed, info.stale_batches, info.stale_events, info.num_events, info.last_seq) == (
        1, 500, 2, 3, 3, 502)
    reply = summary(store)
    assert reply.waiting == 3 and reply.num_events == 3
    assert [entry.type for entry in timeline(store, "b").events] == ["QUEUED"]


def test_actor_restart_resets_baseline_and_loses_its_requests() -> None:
    store = MetricsStore()
    bus = Bus(store)
    bus.publish(SCHEDULER, ActorStarting(pid=1, role="scheduler"), Queued(request_id="a", num_waiting=1),
                Queued(request_id="b", num_waiting=2), Scheduled(request_id="a", step_id=0))
    bus.publish(KV, Allocated(request_id="a", block_ids=[1, 2], num_free_blocks=6))
    bus.tick(1.0)
    bus.publish(SCHEDULER, ActorCrashed(error="boom: out of cheese"))
    assert summary(store).actors[SCHEDULER].state == "CRASHED"
    bus.tick(1.0)
    bus.next_seq[SCHEDULER] = 0  # a new incarnation numbers from zero again
    bus.publish(SCHEDULER, ActorStarting(pid=2, role="scheduler"), ActorReady(pid=2, role="scheduler"))
    assert bus.notices == [ActorRestarted(actor=SCHEDULER, first_seq=0)]
    reply = summary(store)
    info = reply.actors[SCHEDULER]
    assert (info.restarts, info.gaps, info.stale_batches) == (1, 0, 0)
    assert (info.state, info.pid, info.crashes, info.error) == ("READY", 2, 1, "boom: out of cheese")
    assert (reply.running, reply.waiting, reply.requests_lost) == (0, 0, 2)
    assert reply.kv_blocks_in_use == 2  # the KV-cache manager did not restart
    assert store.request_state("a") is RequestState.LOST
    # the frontend aborts what the crash took: counted once, the timelines close
    bus.publish(FRONTEND, Aborted(request_id="a", reason="error"), Aborted(request_id="b", reason="error"))
    reply = summary(store)
    assert reply.aborted_by_reason == {"error": 2} and reply.open_requests == 0
    # a restart of the KV-cache manager whose STARTING batch was lost: a lower seq stamped later
    bus.tick(1.0)
    bus.next_seq[KV] = 0
    bus.publish(KV, Heartbeat(pid=9))
    reply = summary(store)
    assert reply.actors[KV].restarts == 1 and reply.kv_blocks_in_use == 0


def test_sequence_tracker_verdicts() -> None:
    tracker = SequenceTracker()

    def batch(first: int, count: int, mono: float, starting: bool = False) -> EventBatch:
        events: list[Event] = [Heartbeat(pid=1) for _ in range(count)]
        if starting:
            events[0] = ActorStarting(pid=1, role="x")
        return EventBatch(actor="x", first_seq=first, mono=mono, wall=mono, events=events)

    assert tracker.check(batch(10, 2, 1.0)).verdict is SeqVerdict.FIRST
    assert tracker.check(batch(12, 1, 2.0)).verdict is SeqVerdict.IN_ORDER
    gap = tracker.check(batch(20, 1, 3.0))
    assert (gap.verdict, gap.missed) == (SeqVerdict.GAP, 7)
    stale = tracker.check(batch(12, 1, 2.0))
    assert (stale.verdict, stale.skip) == (SeqVerdict.STALE, 1)
    assert tracker.check(batch(0, 2, 1.5, starting=True)).verdict is SeqVerdict.RESTART
    assert tracker.expected("x") == 2
    assert tracker.check(batch(2, 0, 1.6)).verdict is SeqVerdict.IN_ORDER  # an empty batch


# --------------------------------------------------------------------------- bounds, dumps, queries
def test_bounded_history_and_events_query() -> None:
    store = MetricsStore(max_events=10)
    bus = Bus(store)
    for index in range(25):
        bus.publish(WORKER, StepStarted(step_id=index, num_seqs=1, num_tokens=1, num_prefill_seqs=0))
    reply = summary(store)
    assert (reply.num_events, reply.num_retained) == (25, 10)
    events = store.query(EventsQuery(since_index=0, limit=4))
    assert isinstance(events, EventsReply)
    assert (events.first_index, events.next_index, events.missed) == (15, 19, 15)
    assert [entry.seq for entry in events.events] == [15, 16, 17, 18]
    tail = store.query(EventsQuery(since_index=-3, limit=100))
    assert [entry.seq for entry in tail.events] == [22, 23, 24] and tail.next_index == 25  # type: ignore[union-attr]
    caught_up = store.query(EventsQuery(since_index=25))
    assert caught_up == EventsReply(first_index=25, next_index=25, missed=0, events=[])


def test_finished_timelines_are_bounded() -> None:
    store = MetricsStore(max_finished_requests=3, max_open_requests=4)
    bus = Bus(store)
    for index in range(5):
        bus.publish(SCHEDULER, Queued(request_id=f"r{index}", num_waiting=1),
                    Aborted(request_id=f"r{index}", reason="abort"))
    assert [timeline(store, f"r{index}").found for index in range(5)] == [False, False, True, True, True]
    for index in range(6):  # never end: the oldest open ones are dropped
        bus.publish(SCHEDULER, Queued(request_id=f"o{index}", num_waiting=index))
    reply = summary(store)
    assert (reply.open_requests, reply.waiting, reply.requests_evicted) == (4, 4, 2)
    assert bus.notices == [OpenRequestDropped(request_id="o0", state="waiting"),
                           OpenRequestDropped(request_id="o1", state="waiting")]


def test_long_timelines_are_capped_but_keep_their_lifecycle() -> None:
    store = MetricsStore(max_timeline_events=8)
    bus = Bus(store)
    bus.publish(SCHEDULER, Queued(request_id="a", num_waiting=1), Scheduled(request_id="a", step_id=0))
    for step in range(20):
        bus.publish(SCHEDULER, Tokens(step_id=step, request_ids=["a"], num_output_tokens=[step + 1]))
    bus.publish(SCHEDULER, Finished(request_id="a", reason="length", num_prompt_tokens=1, num_output_tokens=20))
    reply = timeline(store, "a")
    assert len(reply.events) == 2 + 8 + 1 and reply.dropped == 12  # at most 8 TOKENS entries
    kept = [entry.event.num_output_tokens for entry in reply.events[2:10]]  # type: ignore[union-attr]
    assert kept == [[n] for n in range(1, 9)]
    assert reply.events[-1].type == "FINISHED"
    assert summary(store).generation_tokens == 20


def test_dump_round_trips(tmp_path: Path) -> None:
    store = MetricsStore(max_events=50)
    run_scenario(store)
    content = store.query(DumpQuery())  # the store makes the content, writes nothing
    assert isinstance(content, DumpContent) and content.num_events == 50
    assert list(tmp_path.iterdir()) == []
    reply = answer(store, DumpQuery(), tmp_path)  # its shell writes a file it names in the dump directory
    assert isinstance(reply, DumpReply) and reply.num_events == 50
    path = Path(reply.path)
    assert path.parent == tmp_path and path.name.startswith("events-") and path.suffix == ".jsonl"
    assert path.stat().st_mode & 0o777 == 0o600
    lines = path.read_text().splitlines()
    assert len(lines) == 50
    retained = store.query(EventsQuery(since_index=0, limit=1000))
    assert isinstance(retained, EventsReply) and len(retained.events) == 50
    expected = [(e.actor, e.seq, e.mono, e.wall, e.event) for e in retained.events]
    assert [parse_event_json_line(line) for line in lines] == expected
    assert list(tmp_path.iterdir()) == [path]  # no temporary left behind


def test_the_in_process_engine_writes_dumps_too(tmp_path: Path) -> None:
    from fake_runner import FakeRunner
    from vllm_actors.clients.inprocess import InProcessEngine
    from vllm_actors.protocol.config import EngineConfig
    from vllm_actors.protocol.sampling import SamplingParams

    config = EngineConfig(model="fake", block_size=4, max_num_batched_tokens=40, max_model_len=512)
    engine = InProcessEngine(config, serialize=False, runner=FakeRunner(num_blocks=16, block_size=4), tokenizer=None)
    engine.submit(engine.prepare("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, ignore_eos=True)))
    while engine.has_unfinished:
        engine.step()
    engine.run_until_idle()
    reply = engine.query_metrics(DumpQuery())
    assert isinstance(reply, DumpReply) and reply.num_events == engine.metrics_store.num_events
    path = tmp_path / "events.jsonl"
    assert save_dump(reply, path) == DumpReply(path=str(path), num_events=reply.num_events)
    assert {parse_event_json_line(line)[4].__class__ for line in path.read_text().splitlines()} >= {Arrived, Finished}


def test_bad_queries_get_error_replies(tmp_path: Path) -> None:
    store = MetricsStore()
    run_scenario(store)
    bad = [
        EventsQuery(since_index=0, limit=0),
        EventsQuery(since_index="x", limit=3),  # type: ignore[arg-type]
        TimelineQuery(request_id=""),
        TimelineQuery(request_id=7),  # type: ignore[arg-type]
        DumpQuery(),  # into a dump directory that is not there
        SeenQuery(actor=3),  # type: ignore[arg-type]
        "summary please",
        None,
    ]
    for query in bad:
        assert isinstance(answer(store, query, tmp_path / "no" / "such"), ErrorReply), query  # type: ignore[arg-type]
        if query is not bad[4]:  # the state machine rejects all but the dump it cannot write
            assert isinstance(store.query(query), ErrorReply), query  # type: ignore[arg-type]
    codec = MetricsCodec()
    for frame in (b"\x00garbage", msgspec.msgpack.encode({"type": "no_such_query"}),
                  msgspec.msgpack.encode({"type": "events_query", "limit": "many"})):
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            codec.decode_query(frame)
        assert answer_frame(store, codec, frame, "metrics", tmp_path) is None  # the shell drops it (and logs)
    reply_frame = answer_frame(store, codec, codec.encode(SummaryQuery()), "metrics", tmp_path)
    assert reply_frame is not None and isinstance(codec.decode_reply(reply_frame), SummaryReply)


def test_a_failing_query_gets_an_error_reply_and_a_log_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    store = MetricsStore()

    def broken(query: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(store, "query", broken)
    with structlog.testing.capture_logs() as logs:
        reply = answer(store, SummaryQuery(), tmp_path)
    assert reply == ErrorReply(message="query failed: RuntimeError: boom")
    assert [(entry["event"], entry["log_level"]) for entry in logs] == [("query failed", "error")]


def test_the_shell_logs_the_store_notices() -> None:
    store = MetricsStore()
    store.record(EventBatch(actor=SCHEDULER, first_seq=0, mono=1.0, wall=WALL0, events=[Heartbeat(pid=1)]))
    with structlog.testing.capture_logs() as logs:
        record_logged(store, EventBatch(actor=SCHEDULER, first_seq=4, mono=2.0, wall=WALL0, events=[Heartbeat(pid=1)]))
    assert logs == [{"event": "event gap", "log_level": "warning", "actor": SCHEDULER, "missed": 3, "first_seq": 4}]


def test_replies_round_trip_through_the_codec() -> None:
    store = MetricsStore()
    run_scenario(store)
    codec = MetricsCodec()
    for query in (SummaryQuery(), TimelineQuery(request_id="p"), SeenQuery(), EventsQuery(since_index=-5)):
        reply = store.query(query)
        assert not isinstance(reply, ErrorReply)
        assert codec.decode_reply(codec.encode(reply)) == reply
        assert codec.decode_query(codec.encode(query)) == query


def test_summary_text() -> None:
    empty = summary_text(summary(MetricsStore()))
    assert "(none seen)" in empty and "ttft" in empty
    store = MetricsStore()
    run_scenario(store)
    bus = Bus(store)
    bus.next_seq[WORKER] = 100
    bus.publish(WORKER, ActorCrashed(error="CUDA error: out of memory"))
    text = summary_text(summary(store))
    for fragment in ("finished 4 (length 2, stop 2)", "aborted 2 (abort 1, error 1)", "0/64 blocks in use",
                     "preemptions 1", "CRASHED", "CUDA error: out of memory", "step", "e2e"):
        assert fragment in text, fragment


def test_constructor_rejects_nonsense_bounds() -> None:
    with pytest.raises(ValueError):
        MetricsStore(max_events=0)


# --------------------------------------------------------------------------- property tests
@st.composite
def lifecycles(draw: st.DrawFn, request_id: str) -> list[tuple[str, Event]]:
    """One request's events from admission to its end, as its actors publish them."""
    prompt = draw(st.integers(1, 40))
    out: list[tuple[str, Event]] = [(FRONTEND, Arrived(request_id=request_id, num_prompt_tokens=prompt, max_tokens=8))]
    if draw(st.booleans()) and draw(st.booleans()):
        return [*out, (SCHEDULER, Aborted(request_id=request_id, reason="error"))]
    out.append((SCHEDULER, Queued(request_id=request_id, num_waiting=1)))
    if draw(st.integers(0, 5)) == 0:
        return [*out, (FRONTEND, Aborted(request_id=request_id, reason="abort")),
                (SCHEDULER, Aborted(request_id=request_id, reason="abort"))]
    step, generated, blocks, admitted = 0, 0, 0, False
    for action in draw(st.lists(st.sampled_from(["token", "token", "preempt"]), min_size=1, max_size=8)):
        if not admitted:
            admission = Resumed if step else Scheduled
            out.append((SCHEDULER, admission(request_id=request_id, step_id=step)))
            out.append((SCHEDULER, PrefillChunk(request_id=request_id, step_id=step, start=0, num_tokens=prompt,
                                                last=True)))
            out.append((KV, Allocated(request_id=request_id, block_ids=[0, 1], num_free_blocks=10)))
            blocks, admitted = 2, True
        step += 1
        if action == "token":
            generated += 1
            if generated == 1:
                out.append((SCHEDULER, FirstToken(request_id=request_id, step_id=step)))
            out.append((SCHEDULER, Tokens(step_id=step, request_ids=[request_id], num_output_tokens=[generated])))
        else:
            out.append((SCHEDULER, Preempted(request_id=request_id, step_id=step, num_computed_tokens=prompt)))
            out.append((KV, Freed(request_id=request_id, num_blocks=blocks, num_free_blocks=12)))
            blocks, admitted = 0, False
    end = draw(st.sampled_from(["finish", "stop_string", "abort"]))
    if end == "finish":
        out.append((SCHEDULER, Finished(request_id=request_id, reason="length", num_prompt_tokens=prompt,
                                        num_output_tokens=generated)))
    elif end == "stop_string":
        out.append((FRONTEND, Finished(request_id=request_id, reason="stop", num_prompt_tokens=prompt,
                                       num_output_tokens=generated)))
        if admitted:  # the step already running still reports a token
            out.append((SCHEDULER, Tokens(step_id=step + 1, request_ids=[request_id],
                                          num_output_tokens=[generated + 1])))
    else:
        out.append((SCHEDULER, Aborted(request_id=request_id, reason="disconnect", num_output_tokens=generated)))
    if blocks:
        out.append((KV, Freed(request_id=request_id, num_blocks=blocks, num_free_blocks=12)))
    return out


@st.composite
def interleaved_streams(draw: st.DrawFn) -> tuple[list[list[tuple[str, Event]]], list[tuple[str, list[Event]]]]:
    """Several lifecycles interleaved at random (each keeps its own order), cut into batches."""
    num = draw(st.integers(1, 6))
    stories = [draw(lifecycles(f"r{index}" if index % 3 else f"p#{index}")) for index in range(num)]
    rng = draw(st.randoms(use_true_random=False))
    cursors = [0] * num
    batches: list[tuple[str, list[Event]]] = []
    live = [index for index in range(num) if stories[index]]
    while live:
        index = rng.choice(live)
        actor, event = stories[index][cursors[index]]
        cursors[index] += 1
        if cursors[index] == len(stories[index]):
            live.remove(index)
        if batches and batches[-1][0] == actor and rng.random() < 0.5:
            batches[-1][1].append(event)
        else:
            batches.append((actor, [event]))
    return stories, batches


FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FAST
@given(interleaved_streams())
def test_random_interleavings_keep_gauges_sane_and_end_at_zero(
    streams: tuple[list[list[tuple[str, Event]]], list[tuple[str, list[Event]]]],
) -> None:
    stories, batches = streams
    store = MetricsStore()
    bus = Bus(store)
    for actor, events in batches:
        bus.tick(0.001)
        bus.publish(actor, *events)
        assert_gauges_sane(summary(store))
    reply = summary(store)
    assert (reply.running, reply.waiting, reply.open_requests, reply.kv_blocks_in_use) == (0, 0, 0, 0)
    assert reply.requests_arrived == len(stories)
    assert reply.requests_finished + reply.requests_aborted == len(stories)
    assert reply.num_events == sum(len(story) for story in stories)
    for story in stories:
        request_id = story[0][1].request_id  # type: ignore[union-attr]
        got = [(entry.actor, entry.event) for entry in timeline(store, request_id, include_children=False).events]
        assert sorted(got, key=repr) == sorted(story, key=repr)
        for actor in (FRONTEND, SCHEDULER, KV):  # one actor's events keep their order
            assert [event for a, event in got if a == actor] == [event for a, event in story if a == actor]


@FAST
@given(interleaved_streams(), st.lists(st.booleans(), max_size=80))
def test_lost_batches_never_break_the_store(
    streams: tuple[list[list[tuple[str, Event]]], list[tuple[str, list[Event]]]], lost: list[bool],
) -> None:
    _, batches = streams
    store = MetricsStore(max_finished_requests=2, max_open_requests=3)
    bus = Bus(store)
    for index, (actor, events) in enumerate(batches):
        bus.tick(0.001)
        bus.publish(actor, *events, deliver=not (index < len(lost) and lost[index]))
        assert_gauges_sane(summary(store))
    missed = sum(seen.missed for seen in summary(store).actors.values())
    delivered = sum(len(batch.events) for index, batch in enumerate(bus.batches)
                    if not (index < len(lost) and lost[index]))
    assert summary(store).num_events == delivered
    assert missed <= sum(len(batch.events) for batch in bus.batches) - delivered


request_ids = st.sampled_from(["a", "b", "c#0", "c#1"])
counts = st.integers(-3, 50)
any_event = st.one_of(
    st.builds(Arrived, request_id=request_ids, num_prompt_tokens=counts, max_tokens=counts),
    st.builds(Queued, request_id=request_ids, num_waiting=counts),
    st.builds(Scheduled, request_id=request_ids, step_id=counts),
    st.builds(Resumed, request_id=request_ids, step_id=counts),
    st.builds(PrefillChunk, request_id=request_ids, step_id=counts, start=counts, num_tokens=counts,
              last=st.booleans()),
    st.builds(FirstToken, request_id=request_ids, step_id=counts),
    st.builds(Tokens, step_id=counts, request_ids=st.lists(request_ids, max_size=4),
              num_output_tokens=st.lists(counts, max_size=4)),
    st.builds(Preempted, request_id=request_ids, step_id=counts, num_computed_tokens=counts),
    st.builds(Finished, request_id=request_ids, reason=st.sampled_from(["stop", "length"]), num_prompt_tokens=counts,
              num_output_tokens=counts),
    st.builds(Aborted, request_id=request_ids, reason=st.sampled_from(["abort", "error"])),
    st.builds(Allocated, request_id=request_ids, block_ids=st.lists(counts, max_size=3), num_free_blocks=counts),
    st.builds(Freed, request_id=request_ids, num_blocks=counts, num_free_blocks=counts),
    st.builds(StepFinished, step_id=counts, num_seqs=counts, num_tokens=counts, num_sampled=counts,
              execute_ms=st.floats(allow_nan=True, allow_infinity=True)),
    st.builds(ActorStarting, pid=counts, role=st.just("x")),
    st.builds(ActorCrashed, error=st.text(max_size=5)),
)
any_batch = st.builds(EventBatch, actor=st.sampled_from([FRONTEND, SCHEDULER, KV]), first_seq=st.integers(0, 30),
                      mono=st.floats(0, 100), wall=st.floats(0, 100), events=st.lists(any_event, max_size=5))


@FAST
@given(st.lists(any_batch, max_size=25))
def test_arbitrary_event_soup_never_raises(batches: list[EventBatch]) -> None:
    store = MetricsStore(max_events=20, max_finished_requests=2, max_open_requests=3, max_timeline_events=3)
    for batch in batches:
        store.record(batch)
        assert_gauges_sane(summary(store))
    for query in (TimelineQuery(request_id="c"), SeenQuery(), EventsQuery(since_index=-7, limit=3)):
        assert not isinstance(store.query(query), ErrorReply)
    summary_text(summary(store))


def test_a_dump_query_never_chooses_the_file(tmp_path: Path) -> None:
    """A ``path`` in a dump query off the wire (as the old protocol had it) is ignored: the file
    goes in the dump directory under the store's name, never where the query says."""
    store = MetricsStore(max_events=50)
    run_scenario(store)
    codec = MetricsCodec()
    dump_dir, outside = tmp_path / "run", tmp_path / "outside"
    dump_dir.mkdir()
    outside.mkdir()
    target = outside / "chosen.jsonl"
    for path in (str(target), "../outside/chosen.jsonl", "/etc/passwd"):
        frame = msgspec.msgpack.encode({"type": "dump_query", "path": path})
        reply_frame = answer_frame(store, codec, frame, "metrics", dump_dir)
        assert reply_frame is not None
        reply = codec.decode_reply(reply_frame)
        assert isinstance(reply, DumpReply) and Path(reply.path).parent == dump_dir
    assert list(outside.iterdir()) == []
    assert len(list(dump_dir.iterdir())) == 3  # one new file per dump, none overwritten
