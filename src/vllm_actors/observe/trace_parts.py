"""The pieces ``observe.trace`` builds a Chrome trace from: slices, worker steps, request
threads, event args, and the layout of slices on one thread. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_actors.protocol.events import Event

MAX_LIST_ARGS = 4  # longer lists in args (block ids, hashes) are cut, with the count of the rest


@dataclass
class Slice:
    ts: float
    end: float
    name: str
    args: dict[str, Any]
    flow: int | None = None  # flow id: an arrow from this slice to its step's
    flows_in: list[int] = field(default_factory=list)  # a step's: the arrows into it


@dataclass
class Step:
    start: float
    end: float
    args: dict[str, Any]
    keys: list[str]
    flows: list[int] = field(default_factory=list)


@dataclass
class RequestTrack:
    tid: int
    shown: bool
    start: float | None = None
    end: float | None = None
    end_args: dict[str, Any] = field(default_factory=dict)
    slices: list[Slice] = field(default_factory=list)
    queued: tuple[float, str, str] | None = None  # since, name, key
    chunks: dict[int, Slice] = field(default_factory=dict)  # step id -> the chunk run in it
    run: Slice | None = None  # the decode run being merged (detail "runs")
    arrived: float | None = None
    first_token: float | None = None
    ended: float | None = None  # FINISHED (not ABORTED)
    targets: dict[str, float] = field(default_factory=dict)  # DEADLINES' fields found in its events


def source_key(actor: str, seq: int) -> str:
    return f"{actor}:{seq}"


def event_args(event: Event) -> dict[str, Any]:
    fields = msgspec.to_builtins(event)
    fields.pop("type", None)
    fields.pop("request_id", None)
    for name, value in fields.items():
        if isinstance(value, list) and len(value) > MAX_LIST_ARGS:
            fields[name] = [*value[:MAX_LIST_ARGS], f"+{len(value) - MAX_LIST_ARGS} more"]
    return fields


def sequential(slices: list[Slice]) -> list[Slice]:
    """The slices of one nesting level in time order, each starting no earlier than the one before
    ends (slices that overlap on one thread would nest wrongly)."""
    ordered = sorted(slices, key=lambda piece: (piece.ts, -piece.end))
    last = float("-inf")
    for piece in ordered:
        piece.ts = max(piece.ts, last)
        piece.end = max(piece.end, piece.ts)
        last = piece.end
    return ordered


def around_steps(slices: list[Slice]) -> list[Slice]:
    """A request's slices laid out: those placed on worker steps (prefill, decode) keep their
    place; a ``queued`` slice gives way where it overlaps one, in pieces around it (with two steps
    in flight, the step before a preemption may still run, and sample, after PREEMPTED)."""
    placed = sequential([piece for piece in slices if not piece.name.startswith("queued")])
    pieces: list[Slice] = []
    for waiting in (piece for piece in slices if piece.name.startswith("queued")):
        start, end = waiting.ts, waiting.end
        for piece in placed:
            if piece.end <= start or piece.ts >= end:
                continue
            if piece.ts > start:  # the wait before this step
                pieces.append(Slice(start, piece.ts, waiting.name, dict(waiting.args)))
            start = max(start, piece.end)
        if end > start or not pieces:
            pieces.append(Slice(start, max(end, start), waiting.name, dict(waiting.args)))
    return sequential(placed + pieces)


def middle(piece: Slice) -> float:
    return round(piece.ts + (piece.end - piece.ts) / 2, 1)
