"""The metrics store's state machine: timelines, gauges, counters and percentiles of a scripted
scenario (sequence numbers, bounds, dumps and queries: test_metrics_store_queries.py; property
tests: test_metrics_store_properties.py)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterable, Sequence
from itertools import pairwise

import numpy as np
import pytest

from vllm_actors.actors.metrics_store.aggregates import Samples
from vllm_actors.actors.metrics_store.notices import Notice
from vllm_actors.actors.metrics_store.records import RequestState, elapsed
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.protocol.events import (
    Aborted,
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
    Percentiles,
    SummaryQuery,
    SummaryReply,
    TimelineQuery,
    TimelineReply,
)

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
