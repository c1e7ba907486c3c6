"""Checks of a Chrome trace (Trace Event Format) made from the metrics store's event log."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

PHASES = {"X", "B", "E", "i", "I", "C", "M", "s", "t", "f"}


def check_schema(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Valid Chrome trace JSON: the object form, every event with ph/ts/pid/tid/name of the right
    types, durations non-negative, B/E balanced per thread, flows with both ends, ts in
    microseconds from the first event (non-negative numbers). Returns the events."""
    trace = json.loads(json.dumps(trace, allow_nan=False))  # plain JSON, no NaN or infinity
    assert set(trace) >= {"traceEvents"} and trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    open_slices: dict[tuple[int, int], list[str]] = defaultdict(list)
    flows: dict[int, set[str]] = defaultdict(set)
    for event in events:
        for field in ("ph", "ts", "pid", "tid", "name"):
            assert field in event, (field, event)
        assert event["ph"] in PHASES, event
        assert isinstance(event["name"], str) and event["name"]
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert isinstance(event["ts"], (int, float)) and event["ts"] >= 0, event
        if event["ph"] == "X":
            assert isinstance(event["dur"], (int, float)) and event["dur"] >= 0, event
        if event["ph"] == "B":
            open_slices[(event["pid"], event["tid"])].append(event["name"])
        if event["ph"] == "E":
            assert open_slices[(event["pid"], event["tid"])], event
            open_slices[(event["pid"], event["tid"])].pop()
        if event["ph"] == "i":
            assert event.get("s", "t") in ("g", "p", "t")
        if event["ph"] == "C":
            assert all(isinstance(value, (int, float)) for value in event["args"].values()), event
        if event["ph"] in ("s", "f"):
            flows[event["id"]].add(event["ph"])
        if event["ph"] == "M":
            assert event["name"] in ("process_name", "thread_name", "process_sort_index", "thread_sort_index")
    assert not any(open_slices.values()), "unbalanced B/E"
    assert all(ends == {"s", "f"} for ends in flows.values()), "a flow without both ends"
    return events


def check_nesting(events: list[dict[str, Any]]) -> None:
    """On each thread, complete slices either nest or follow each other (no partial overlap)."""
    by_thread: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for event in events:
        if event["ph"] == "X":
            by_thread[(event["pid"], event["tid"])].append((event["ts"], event["ts"] + event["dur"]))
    for spans in by_thread.values():
        stack: list[float] = []
        for start, end in sorted(spans, key=lambda span: (span[0], -span[1])):
            while stack and stack[-1] <= start + 1e-3:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-3, "slices overlap on one thread"
            stack.append(end)


def sources(events: list[dict[str, Any]]) -> set[str]:
    """The log events ("actor:seq") the trace events were made from."""
    found: set[str] = set()
    for event in events:
        for where in (event.get("args") or {}, event):
            keys = where.get("ev")
            if isinstance(keys, str):
                found.add(keys)
            elif isinstance(keys, list):
                found.update(keys)
    return found


def check_covers(trace: dict[str, Any], rows: list[tuple[str, int, float, float, Any]]) -> list[dict[str, Any]]:
    """Valid, and every event of the log maps to something in the trace; timestamps are the
    rows' wall clocks in microseconds from the first."""
    events = check_schema(trace)
    check_nesting(events)
    check_thread_ids(events)
    expected = {f"{actor}:{seq}" for actor, seq, *_ in rows}
    assert len(expected) == len(rows)
    assert sources(events) == expected, sorted(expected - sources(events))[:20]
    t0 = min(row[3] for row in rows)
    assert trace["otherData"]["t0_wall"] == t0
    walls = {f"{actor}:{seq}": wall for actor, seq, _, wall, _ in rows}
    for event in events:  # instants made from an event sit at its stamp, in microseconds
        if event["ph"] == "i" and "ev" in event["args"]:
            assert abs(event["ts"] - (walls[event["args"]["ev"]] - t0) * 1e6) < 1.0
    span = (max(row[3] for row in rows) - t0) * 1e6
    assert max(event["ts"] for event in events if sources([event])) <= span + 1.0  # (a deadline may fall later)
    return events


def check_thread_ids(events: list[dict[str, Any]]) -> None:
    """Each tid belongs to one pid (Perfetto keys threads and their names by tid alone)."""
    owner: dict[int, int] = {}
    for event in events:
        assert owner.setdefault(event["tid"], event["pid"]) == event["pid"], event
