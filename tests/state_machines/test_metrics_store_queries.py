"""The metrics store's sequence numbers (gaps, lost and stale batches, restarts), its bounds, dumps and
queries (the shell's answers, error replies, the codec)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import structlog
import structlog.testing

from tests.state_machines.test_metrics_store import (
    FRONTEND,
    KV,
    SCHEDULER,
    WALL0,
    WORKER,
    Bus,
    assert_gauges_sane,
    run_scenario,
    summary,
    timeline,
)
from vllm_actors.actors.metrics_store.dump import DumpContent
from vllm_actors.actors.metrics_store.notices import ActorRestarted, EventGap, OpenRequestDropped, StaleBatch
from vllm_actors.actors.metrics_store.records import RequestState
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
    GroupFailed,
    Heartbeat,
    Queued,
    Scheduled,
    StepStarted,
    Tokens,
)
from vllm_actors.protocol.metrics import (
    DumpQuery,
    DumpReply,
    ErrorReply,
    EventsQuery,
    EventsReply,
    MetricsCodec,
    SeenQuery,
    SeenReply,
    SummaryQuery,
    SummaryReply,
    TimelineQuery,
    parse_event_json_line,
)
from vllm_actors.runtime.metrics_shell import answer, answer_frame, record_logged


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


def test_a_resent_start_up_handshake_is_neither_a_gap_nor_stale() -> None:
    """An actor resends one stamped handshake until the store sees it (``wait_until_seen``): a late
    copy after the first arrived is expected; a later duplicate of real events is still stale."""
    store = MetricsStore()
    starting = EventBatch(actor=KV, first_seq=0, mono=1.0, wall=WALL0, events=[ActorStarting(pid=1, role="kv")])
    handshake = EventBatch(actor=KV, first_seq=1, mono=1.5, wall=WALL0, events=[Heartbeat(pid=1)])
    ready = EventBatch(actor=KV, first_seq=2, mono=2.0, wall=WALL0, events=[ActorReady(pid=1, role="kv")])
    assert not store.record(starting)
    assert not store.record(handshake)
    assert not store.record(handshake)  # the copy sent while the first was on its way
    assert not store.record(ready)
    assert store.record(ready) == [StaleBatch(actor=KV, first_seq=2, skipped=1)]
    info = store.query(SeenQuery()).actors[KV]  # type: ignore[union-attr]
    assert (info.state, info.gaps, info.stale_batches, info.num_events, info.last_seq) == ("READY", 0, 1, 3, 2)


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
    # interrupted, not lost yet: the frontend resubmits them
    assert (reply.running, reply.waiting, reply.requests_interrupted, reply.requests_lost) == (0, 0, 2, 0)
    assert reply.kv_blocks_in_use == 2  # the KV-cache manager did not restart
    assert store.request_state("a") is RequestState.LOST
    # what the crash took ends with an error: lost, counted once, the timelines close
    bus.publish(FRONTEND, Aborted(request_id="a", reason="error"), Aborted(request_id="b", reason="error"))
    bus.publish(FRONTEND, Aborted(request_id="a", reason="error"))
    reply = summary(store)
    assert reply.aborted_by_reason == {"error": 2} and reply.open_requests == 0
    assert (reply.requests_interrupted, reply.requests_lost) == (2, 2)
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
    from tests.support.fake_runner import FakeRunner
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


def test_requests_a_restart_interrupted_and_that_finished_are_not_lost() -> None:
    """A scheduler restart with 16 requests in flight that all resume and finish: 16 interrupted,
    none lost; a group failure then loses what is open (answered with an error)."""
    store = MetricsStore()
    bus = Bus(store)
    ids = [f"r{i}" for i in range(16)]
    bus.publish(SCHEDULER, ActorStarting(pid=1, role="scheduler"),
                *[Queued(request_id=i, num_waiting=1) for i in ids], *[Scheduled(request_id=i, step_id=0) for i in ids])
    bus.tick(1.0)
    bus.next_seq[SCHEDULER] = 0  # a new incarnation
    bus.publish(SCHEDULER, ActorStarting(pid=2, role="scheduler"), *[Queued(request_id=i, num_waiting=1) for i in ids],
                *[Finished(request_id=i, reason="length", num_prompt_tokens=3, num_output_tokens=4) for i in ids])
    reply = summary(store)
    assert (reply.requests_interrupted, reply.requests_lost, reply.requests_finished) == (16, 0, 16)
    assert "interrupted by a restart 16" in summary_text(reply) and "lost" not in summary_text(reply)
    bus.publish(SCHEDULER, Queued(request_id="open", num_waiting=1), Aborted(request_id="r0", reason="error"))
    bus.publish("supervisor", GroupFailed(reason="restart budget spent"))
    reply = summary(store)
    assert (reply.requests_lost, reply.waiting) == (1, 0)  # only the open one: r0 had finished
    assert "lost 1" in summary_text(reply)
