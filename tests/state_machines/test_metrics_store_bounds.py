"""The metrics store stays bounded in memory whatever arrives: huge ids, many requests, long
generations, many clients, made-up reasons ("bounded memory wherever a client can push").

Batches go through a msgpack round trip, as on the bus: every batch then holds its own copies of
the strings it names (the store once kept a 60 KB request id once per step)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import msgspec
import pytest

from vllm_actors.actors.metrics_store.bounds import MAX_ID_CHARS, MAX_TEXT_CHARS, bounded, cap_id, event_bytes
from vllm_actors.actors.metrics_store.ingest import MAX_CLIENTS
from vllm_actors.actors.metrics_store.queries import MAX_REPLY_BYTES
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.protocol.events import (
    Aborted,
    ActorCrashed,
    Arrived,
    Event,
    EventBatch,
    Finished,
    KvPool,
    Queued,
    Scheduled,
    StepFinished,
    Tokens,
)
from vllm_actors.protocol.metrics import (
    EventsQuery,
    EventsReply,
    SummaryQuery,
    SummaryReply,
    TimelineQuery,
    TimelineReply,
)
from vllm_actors.protocol.names import child_request_id

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


class WireBus:
    """Per-actor sequence numbers; each batch encoded and decoded as the bus would deliver it."""

    def __init__(self, store: MetricsStore) -> None:
        self.store = store
        self.next_seq: dict[str, int] = {}
        self.now = 0.0

    def publish(self, actor: str, *events: Event) -> None:
        seq = self.next_seq.get(actor, 0)
        self.next_seq[actor] = seq + len(events)
        self.now += 0.001
        batch = EventBatch(actor=actor, first_seq=seq, mono=self.now, wall=1e9 + self.now, events=list(events))
        self.store.record(_decoder.decode(_encoder.encode(batch)))


@contextmanager
def traced_growth() -> Iterator[Callable[[], int]]:
    """Bytes allocated (and still held) since entering, as a callable read at any point."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield lambda: tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


def generate(bus: WireBus, request_ids: list[str], steps: int, client: str = "client-1") -> None:
    """Requests arrive, run ``steps`` decode steps together, and finish."""
    for request_id in request_ids:
        bus.publish(client, Arrived(request_id=request_id, num_prompt_tokens=8, max_tokens=steps))
    bus.publish("scheduler", *[Queued(request_id=r, num_waiting=1) for r in request_ids],
                *[Scheduled(request_id=r, step_id=0) for r in request_ids])
    for step in range(steps):
        bus.publish("scheduler", Tokens(step_id=step, request_ids=request_ids,
                                        num_output_tokens=[step + 1] * len(request_ids)))
        bus.publish("kv_cache_manager", KvPool(num_blocks=64, num_free=32, num_cached=0, num_cached_idle=0,
                                               num_in_use=32))
    bus.publish("scheduler", *[Finished(request_id=r, reason="length", num_prompt_tokens=8, num_output_tokens=steps)
                               for r in request_ids])


def accounted(store: MetricsStore) -> bool:
    """The table's byte count is the sum of its records' (no drift)."""
    requests = store._recorder.requests
    return requests.nbytes == sum(r.nbytes for r in [*requests.open.values(), *requests.ended.values()])


def summary(store: MetricsStore) -> SummaryReply:
    reply = store.query(SummaryQuery())
    assert isinstance(reply, SummaryReply)
    return reply


# --------------------------------------------------------------------------- huge strings
def test_huge_request_ids_are_not_copied_into_every_event() -> None:
    # The finding: 32 requests with a 60 KB X-Request-Id, 1,000 tokens each, took the store from
    # 35 MB to 2.19 GB. Here 32 ids of 10 KB over 200 steps (64 MB of ids on the old code).
    store = MetricsStore()
    bus = WireBus(store)
    ids = [f"{index:02d}" + "x" * 10_000 for index in range(32)]
    with traced_growth() as growth:
        generate(bus, ids, steps=200)
        held = growth()
    assert held < 8 << 20, f"the store holds {held / 1e6:.1f} MB for 32 requests"
    assert store.retained_bytes < 8 << 20
    reply = summary(store)
    assert (reply.requests_finished, reply.generation_tokens) == (32, 32 * 200)
    # Every event of one long id still lands on one record, found by the id as the client knows it.
    timeline = store.query(TimelineQuery(request_id=ids[3]))
    assert isinstance(timeline, TimelineReply) and timeline.found and timeline.state == "finished"
    assert len(timeline.request_id) <= MAX_ID_CHARS
    assert {entry.type for entry in timeline.events} >= {"ARRIVED", "QUEUED", "SCHEDULED", "TOKENS", "FINISHED"}
    assert store.request_state(ids[3]) is not None and store.request_state(ids[4] + "y") is None


def test_capped_ids_stay_distinct_and_keep_their_children() -> None:
    a, b = "a" * 5_000 + "1", "a" * 5_000 + "2"  # the same first 5,000 characters
    assert cap_id(a) != cap_id(b) and len(cap_id(a)) <= MAX_ID_CHARS
    assert cap_id("short") == "short"
    child = child_request_id(a, 3)
    assert cap_id(child) == child_request_id(cap_id(a), 3)  # still a child of the capped parent
    store = MetricsStore()
    bus = WireBus(store)
    generate(bus, [child_request_id(a, 0), child_request_id(a, 1), b], steps=2)
    family = store.query(TimelineQuery(request_id=a))
    assert isinstance(family, TimelineReply) and family.found
    assert sum(entry.type == "FINISHED" for entry in family.events) == 2  # both children, not b


def test_other_text_is_cut_and_says_so() -> None:
    crashed = bounded(ActorCrashed(error="e" * 100_000))
    assert isinstance(crashed, ActorCrashed)
    assert len(crashed.error) < MAX_TEXT_CHARS + 32 and crashed.error.endswith(f"(+{100_000 - MAX_TEXT_CHARS} chars)")
    stopped = bounded(Finished(request_id="r", reason="stop", num_prompt_tokens=1, num_output_tokens=1,
                               stop_reason="s" * 10_000))
    assert isinstance(stopped, Finished) and isinstance(stopped.stop_reason, str)
    assert len(stopped.stop_reason) < MAX_TEXT_CHARS + 32
    plain = Tokens(step_id=1, request_ids=["a", "b"], num_output_tokens=[1, 1])
    assert bounded(plain) is plain  # nothing to cap: no copy
    assert event_bytes(bounded(Tokens(step_id=1, request_ids=["x" * 60_000] * 32, num_output_tokens=[1] * 32))) < 20_000


def test_made_up_abort_reasons_do_not_grow_the_counters() -> None:
    store = MetricsStore()
    bus = WireBus(store)
    for index in range(2_000):  # a client may publish ABORTED with any reason
        bus.publish("client-1", Arrived(request_id=f"r{index}", num_prompt_tokens=1, max_tokens=1),
                    Aborted(request_id=f"r{index}", reason=f"reason-{index}-" + "z" * 1_000))
    reasons = summary(store).aborted_by_reason
    assert len(reasons) <= 65 and reasons["other"] > 1_900
    assert sum(reasons.values()) == 2_000
    assert max(map(len, reasons)) < MAX_TEXT_CHARS + 32


# --------------------------------------------------------------------------- bytes and counts
def test_the_event_log_is_bounded_in_bytes() -> None:
    store = MetricsStore(max_events=1_000_000, max_history_bytes=1 << 20, max_request_bytes=1 << 20)
    bus = WireBus(store)
    ids = [f"request-{index:04d}-{'p' * 40}" for index in range(64)]
    with traced_growth() as growth:
        for round_ in range(8):
            generate(bus, [f"{r}-{round_}" for r in ids], steps=100)
        held = growth()
    assert store.num_retained < store.num_events // 4  # far fewer than max_events
    assert store._recorder.history.nbytes <= 1 << 20
    assert held < 4 << 20, f"the store holds {held / 1e6:.1f} MB"


def test_finished_records_are_bounded_in_bytes_oldest_first() -> None:
    store = MetricsStore(max_finished_requests=1_000_000, max_request_bytes=2 << 20)
    bus = WireBus(store)
    for round_ in range(40):  # 40 x 16 requests of 200 tokens: a timeline each
        generate(bus, [f"g{round_}-{index}" for index in range(16)], steps=200)
    sizes = store.table_sizes()
    assert store._recorder.requests.nbytes <= 2 << 20
    assert 16 <= sizes["ended"] < 40 * 16
    assert store.request_state("g0-0") is None and store.request_state("g39-15") is not None
    assert summary(store).requests_finished == 40 * 16  # the counters keep counting
    assert accounted(store)


def test_open_records_stop_growing_past_the_byte_budget_when_nothing_ended_is_left() -> None:
    store = MetricsStore(max_request_bytes=256 << 10)
    bus = WireBus(store)
    ids = [f"open-{index}" for index in range(64)]
    bus.publish("scheduler", *[Queued(request_id=r, num_waiting=1) for r in ids],
                *[Scheduled(request_id=r, step_id=0) for r in ids])
    for step in range(200):  # they never finish
        bus.publish("scheduler", Tokens(step_id=step, request_ids=ids, num_output_tokens=[step + 1] * 64))
    assert store._recorder.requests.nbytes <= (256 << 10) + 64 * 64  # one step's rows over, at most
    reply = summary(store)
    assert (reply.open_requests, reply.running, reply.requests_evicted) == (64, 64, 0)  # none dropped
    assert reply.generation_tokens == 64 * 200  # the counters keep counting
    timeline = store.query(TimelineQuery(request_id="open-0"))
    assert isinstance(timeline, TimelineReply) and timeline.dropped > 0
    assert accounted(store)


def test_many_clients_are_remembered_up_to_a_bound() -> None:
    store = MetricsStore()
    bus = WireBus(store)
    bus.publish("scheduler", StepFinished(step_id=0, num_seqs=0, num_tokens=0, num_sampled=0, execute_ms=1.0))
    for index in range(MAX_CLIENTS + 500):
        bus.publish(f"client-{index}", Arrived(request_id=f"c{index}", num_prompt_tokens=1, max_tokens=1))
    actors = store.table_sizes()["actors"]
    assert actors <= MAX_CLIENTS + 1
    assert "scheduler" in summary(store).actors  # engine actors are never forgotten
    assert len(store._recorder.sequences._next) == actors
    long_actor = "x" * 100_000
    bus.publish(long_actor, Arrived(request_id="long", num_prompt_tokens=1, max_tokens=1))
    store.record(EventBatch(actor=long_actor, first_seq=1, mono=9.0, wall=1e9 + 9,
                            events=[Arrived(request_id="long2", num_prompt_tokens=1, max_tokens=1)]),
                 topic=long_actor)  # under its own (long) topic: applied
    assert max(map(len, summary(store).actors)) <= MAX_ID_CHARS
    assert summary(store).rejected_batches == 0 and store.request_state("long2") is not None


@pytest.mark.parametrize("steps", [1, 50])
def test_estimates_are_of_the_right_order(steps: int) -> None:
    # The byte budgets are only as good as the estimates: they must not be far below the truth.
    store = MetricsStore()
    bus = WireBus(store)
    with traced_growth() as growth:
        for round_ in range(8):
            generate(bus, [f"req-{round_}-{index}-{'q' * 30}" for index in range(32)], steps=steps)
        held = growth()
    assert store.retained_bytes > 0.6 * held, (store.retained_bytes, held)
    assert store.retained_bytes < 3 * held, (store.retained_bytes, held)


def test_an_events_query_reply_is_bounded_in_bytes() -> None:
    store = MetricsStore()
    bus = WireBus(store)
    ids = [f"{index:03d}" + "i" * 250 for index in range(128)]  # ~40 KB per TOKENS event
    bus.publish("scheduler", *[Queued(request_id=r, num_waiting=1) for r in ids])
    for step in range(600):
        bus.publish("scheduler", Tokens(step_id=step, request_ids=ids, num_output_tokens=[step + 1] * 128))
    reply = store.query(EventsQuery(since_index=0, limit=10_000))
    assert isinstance(reply, EventsReply) and 0 < len(reply.events) < 601
    assert len(msgspec.msgpack.encode(reply)) <= MAX_REPLY_BYTES
    rest = store.query(EventsQuery(since_index=reply.next_index, limit=10_000))  # the rest, in order
    assert isinstance(rest, EventsReply) and rest.first_index == reply.next_index and rest.missed == 0
