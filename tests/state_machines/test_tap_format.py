"""Event taps: filter semantics, gap lines, one-line and JSON-lines formatting, colour on and off."""

from __future__ import annotations

import datetime
import json
import re

import pytest

from vllm_actors.observe.tap_format import (
    EVENT_GROUPS,
    GapTracker,
    TapFilter,
    format_event,
    format_event_json,
    format_gap,
    render_batch,
    resolve_types,
)
from vllm_actors.protocol.events import (
    ALL_EVENTS,
    Aborted,
    ActorCrashed,
    ActorReady,
    ActorStarting,
    Allocated,
    Arrived,
    Event,
    EventBatch,
    Finished,
    Freed,
    Heartbeat,
    PrefillChunk,
    Queued,
    StepFinished,
    StepStarted,
    Tokens,
    event_type,
)
from vllm_actors.protocol.metrics import parse_event_json_line

WALL = 1_700_000_123.456789
ANSI = re.compile(r"\x1b\[[0-9;]*m")

SAMPLES: list[Event] = [
    Arrived(request_id="r1", num_prompt_tokens=12, max_tokens=5),
    Queued(request_id="r1", num_waiting=3),
    PrefillChunk(request_id="r1#1", step_id=4, start=0, num_tokens=12, last=True),
    Tokens(step_id=4, request_ids=["r9", "r1#0"], num_output_tokens=[7, 1]),
    Finished(request_id="r1", reason="stop", num_prompt_tokens=12, num_output_tokens=5, stop_reason="two words"),
    Aborted(request_id="r2", reason="disconnect"),
    Allocated(request_id="r1", block_ids=list(range(10)), num_free_blocks=90),
    Freed(request_id="r1", num_blocks=10, num_free_blocks=100),
    StepStarted(step_id=4, num_seqs=2, num_tokens=13, num_prefill_seqs=1),
    StepFinished(step_id=4, num_seqs=2, num_tokens=13, num_sampled=2, execute_ms=12.3456),
    ActorStarting(pid=42, role="scheduler"),
    ActorReady(pid=42, role="scheduler"),
    ActorCrashed(error="RuntimeError: CUDA error: an illegal memory access was encountered"),
    Heartbeat(pid=42),
]


def batch(actor: str, first_seq: int, *events: Event, wall: float = WALL) -> EventBatch:
    return EventBatch(actor=actor, first_seq=first_seq, mono=wall - 1_699_000_000.0, wall=wall, events=list(events))


# --------------------------------------------------------------------------- filters
def test_types_are_case_insensitive_and_groups_expand() -> None:
    assert resolve_types(["finished", "Tokens"]) == {"FINISHED", "TOKENS"}
    assert resolve_types(["kv"]) == {"ALLOCATED", "FREED", "PREFIX_HIT", "BLOCK_CACHED", "BLOCK_EVICTED",
                                     "BLOCK_OFFLOADED", "BLOCK_RESTORED", "KV_POOL", "KV_LENT", "KV_RETURNED"}
    assert resolve_types(["requests", "worker"]) == EVENT_GROUPS["REQUEST"] | {"STEP_STARTED", "STEP_FINISHED",
                                                                               "STEP_TIMED"}
    every = resolve_types(EVENT_GROUPS)
    assert every == {cls.__struct_config__.tag for cls in ALL_EVENTS}  # the groups cover every event
    with pytest.raises(ValueError, match="FINSIHED"):
        TapFilter(types={"FINSIHED"})


def test_type_filter() -> None:
    only = TapFilter(types={"finished", "kv"})
    assert [event_type(e) for e in SAMPLES if only.matches("x", e)] == ["FINISHED", "ALLOCATED", "FREED"]
    actors = TapFilter(types={"ACTOR"})
    assert [event_type(e) for e in SAMPLES if actors.matches("x", e)] == ["STARTING", "READY", "CRASHED", "HEARTBEAT"]
    assert all(TapFilter().matches("x", e) for e in SAMPLES)


def test_actor_filter_exact_and_patterns() -> None:
    tap = TapFilter(actors={"scheduler", "worker-*"})
    event = Heartbeat(pid=1)
    assert tap.matches("scheduler", event) and tap.matches("worker-3", event)
    assert not tap.matches("frontend", event) and not tap.matches("scheduler-2", event)


def test_request_filter() -> None:
    tap = TapFilter(request_ids={"r1"})
    matched = [event_type(e) for e in SAMPLES if tap.matches("x", e)]
    # children r1#0 / r1#1 match their parent; TOKENS match through any listed id; no step or
    # lifecycle event concerns a request
    assert matched == ["ARRIVED", "QUEUED", "PREFILL_CHUNK", "TOKENS", "FINISHED", "ALLOCATED", "FREED"]
    child = TapFilter(request_ids={"r1#1"})
    assert [event_type(e) for e in SAMPLES if child.matches("x", e)] == ["PREFILL_CHUNK"]
    assert not TapFilter(request_ids={"r"}).matches("x", Arrived(request_id="r1", num_prompt_tokens=1, max_tokens=1))
    combined = TapFilter(types={"tokens"}, actors={"scheduler"}, request_ids={"r9"})
    assert combined.matches("scheduler", SAMPLES[3]) and not combined.matches("frontend", SAMPLES[3])


# --------------------------------------------------------------------------- gaps
def test_gap_tracker() -> None:
    gaps = GapTracker()
    assert gaps.observe(batch("s", 100, Heartbeat(pid=1), Heartbeat(pid=1))) == 0  # joined mid-stream
    assert gaps.observe(batch("s", 102, Heartbeat(pid=1))) == 0
    assert gaps.observe(batch("w", 0, Heartbeat(pid=1))) == 0  # actors are independent
    assert gaps.observe(batch("s", 110, Heartbeat(pid=1), wall=WALL + 1)) == 7
    assert gaps.observe(batch("s", 0, ActorStarting(pid=2, role="s"), wall=WALL + 2)) == 0  # a restart
    assert gaps.observe(batch("s", 1, Heartbeat(pid=2), wall=WALL + 3)) == 0
    assert gaps.observe(batch("s", 1, Heartbeat(pid=2), wall=WALL + 3)) == 0  # a duplicate
    assert gaps.missed == {"s": 7}


def test_render_batch_puts_the_gap_line_first() -> None:
    gaps = GapTracker()
    assert len(render_batch(batch("s", 0, Heartbeat(pid=1)), None, gaps, color=False, as_json=False)) == 1
    lines = render_batch(batch("s", 5, Heartbeat(pid=1), ActorReady(pid=1, role="s")), TapFilter(), gaps,
                         color=False, as_json=False)
    assert lines[0] == format_gap("s", 4, color=False) == "--- s: 4 events missed ---"
    assert "#5" in lines[1] and "HEARTBEAT" in lines[1] and "READY" in lines[2]
    # an actor the filter leaves out shows neither its events nor its gaps
    other = render_batch(batch("w", 0), TapFilter(actors={"s"}), gaps, color=False, as_json=False)
    assert render_batch(batch("w", 9, Heartbeat(pid=3)), TapFilter(actors={"s"}), gaps, False, False) == other == []
    # a type filter still shows the gap: what was lost may have been wanted
    lines = render_batch(batch("s", 20, Heartbeat(pid=1)), TapFilter(types={"FINISHED"}), gaps, False, False)
    assert lines == ["--- s: 13 events missed ---"]


def test_render_batch_json_lines_parse_back() -> None:
    gaps = GapTracker()
    render_batch(batch("s", 0, Heartbeat(pid=1)), None, gaps, color=True, as_json=True)
    lines = render_batch(batch("s", 3, *SAMPLES), None, gaps, color=True, as_json=True)
    assert json.loads(lines[0]) == {"actor": "s", "type": "GAP", "missed": 2}
    assert len(lines) == 1 + len(SAMPLES)
    for index, (line, event) in enumerate(zip(lines[1:], SAMPLES, strict=True)):
        assert "\x1b" not in line  # JSON never carries colour
        record = json.loads(line)
        assert list(record)[:5] == ["actor", "seq", "mono", "wall", "type"]
        assert (record["seq"], record["type"]) == (3 + index, event_type(event))
        actor, seq, _, wall, parsed = parse_event_json_line(line)
        assert (actor, seq, wall, parsed) == ("s", 3 + index, WALL, event)


def test_render_batch_narrows_tokens_to_the_filtered_requests() -> None:
    tokens = Tokens(step_id=9, request_ids=["a", "r1#0", "b", "r1#1"], num_output_tokens=[3, 4, 5, 6])
    lines = render_batch(batch("s", 0, tokens), TapFilter(request_ids={"r1"}), GapTracker(), False, True)
    record = json.loads(lines[0])
    assert (record["request_ids"], record["num_output_tokens"]) == (["r1#0", "r1#1"], [4, 6])


# --------------------------------------------------------------------------- lines
def test_format_event_line_layout() -> None:
    line = format_event("scheduler", 1234, WALL, SAMPLES[4], color=False)
    clock = datetime.datetime.fromtimestamp(WALL).strftime("%H:%M:%S")
    assert line.startswith(f"{clock}.456 scheduler")
    assert re.match(r"^\d\d:\d\d:\d\d\.\d{3} scheduler +#1234 +FINISHED +request_id=r1 reason=stop", line)
    assert 'stop_reason="two words"' in line  # strings with spaces are quoted
    step = format_event("worker-0", 7, WALL, SAMPLES[9], color=False)
    assert "execute_ms=12.346" in step
    arrived = format_event("frontend", 0, WALL, SAMPLES[0], color=False)
    assert arrived.endswith("ARRIVED       request_id=r1 num_prompt_tokens=12 max_tokens=5 priority=0")
    assert "deadline" not in arrived  # optional fields left unset are not shown


def test_long_lists_are_truncated() -> None:
    ids = [f"req-{index}" for index in range(256)]
    line = format_event("scheduler", 1, WALL, Tokens(step_id=3, request_ids=ids, num_output_tokens=list(range(256))),
                        color=False)
    assert "n=256" in line and "req-0:0 req-1:1 req-2:2 req-3:3 …+252" in line and "req-4" not in line
    assert len(line) < 160
    blocks = format_event("kv", 1, WALL, SAMPLES[6], color=False)
    assert "block_ids=[0,1,2,3,…+6]" in blocks
    crash = format_event("w", 1, WALL, ActorCrashed(error="x" * 1000), color=False)
    assert len(crash) < 250 and crash.endswith("x…")


def test_colour_on_and_off() -> None:
    for event in SAMPLES:
        plain = format_event("a", 1, WALL, event, color=False)
        coloured = format_event("a", 1, WALL, event, color=True)
        assert "\x1b" not in plain
        assert "\x1b[" in coloured
        assert ANSI.sub("", coloured) == plain  # colour changes nothing but colour
    crashed = format_event("a", 1, WALL, SAMPLES[12], color=True)
    assert "\x1b[1;31mCRASHED" in crashed
    kinds = {event_type(e): format_event("a", 1, WALL, e, color=True) for e in SAMPLES}
    assert "\x1b[36mQUEUED" in kinds["QUEUED"]  # request events
    assert "\x1b[35mALLOCATED" in kinds["ALLOCATED"]  # KV
    assert "\x1b[34mSTEP_STARTED" in kinds["STEP_STARTED"]  # worker
    assert "\x1b[1mREADY" in kinds["READY"]  # lifecycle
    assert format_gap("s", 1, color=True).startswith("\x1b[") and "1 event missed" in format_gap("s", 1, False)


def test_format_event_json_is_the_dump_format() -> None:
    for seq, event in enumerate(SAMPLES):
        line = format_event_json("kv", seq, 5.5, WALL, event)
        assert "\n" not in line
        assert parse_event_json_line(line) == ("kv", seq, 5.5, WALL, event)
