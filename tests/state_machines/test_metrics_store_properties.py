"""Property tests of the metrics store: random interleavings, lost batches and event soup never break
it, and its gauges end at zero."""

from __future__ import annotations

from pathlib import Path

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.state_machines.test_metrics_store import (
    FRONTEND,
    KV,
    SCHEDULER,
    Bus,
    assert_gauges_sane,
    run_scenario,
    summary,
    timeline,
)
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.observe.stats_text import summary_text
from vllm_actors.protocol.events import (
    Aborted,
    ActorCrashed,
    ActorStarting,
    Allocated,
    Arrived,
    Event,
    EventBatch,
    Finished,
    FirstToken,
    Freed,
    Preempted,
    PrefillChunk,
    Queued,
    Resumed,
    Scheduled,
    StepFinished,
    Tokens,
)
from vllm_actors.protocol.metrics import (
    DumpReply,
    ErrorReply,
    EventsQuery,
    MetricsCodec,
    SeenQuery,
    TimelineQuery,
)
from vllm_actors.runtime.metrics_shell import answer_frame


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
