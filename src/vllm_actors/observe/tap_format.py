"""Event taps: which events a tap shows (``TapFilter``), what it missed (``GapTracker``) and how
each event reads as one line (``format_event``, or ``format_event_json`` for machines).

Pure functions: the tap's ZMQ shell subscribes to the bus and prints ``render_batch``'s lines.
"""

from __future__ import annotations

import datetime
import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_actors.actors.metrics_store.sequence_tracker import SequenceTracker, SeqVerdict
from vllm_actors.protocol.events import (
    ALL_EVENTS,
    REQUEST_EVENTS,
    ActorCrashed,
    Event,
    EventBatch,
    Routed,
    Tokens,
    event_type,
    stamped,
)
from vllm_actors.protocol.metrics import event_json_line
from vllm_actors.protocol.names import parent_request_id, replica_of

# Event groups a filter may name instead of single types.
EVENT_GROUPS: dict[str, frozenset[str]] = {
    "REQUEST": frozenset(REQUEST_EVENTS),
    "KV": frozenset({"ALLOCATED", "FREED", "PREFIX_HIT", "BLOCK_CACHED", "BLOCK_EVICTED", "BLOCK_OFFLOADED",
                        "BLOCK_RESTORED", "KV_POOL", "KV_LENT", "KV_RETURNED"}),
    "WORKER": frozenset({"STEP_STARTED", "STEP_FINISHED", "STEP_TIMED"}),
    "ACTOR": frozenset({"STARTING", "READY", "DRAINING", "STOPPED", "CRASHED", "HEARTBEAT", "REJECTED",
                        "ACTOR_FAILED", "ACTOR_RESTARTED", "GROUP_FAILED", "PIPELINE_RESET",
                        "KV_SHARE_RECOVERED", "SLEEP_STATE"}),
}
ALL_EVENT_TYPES: frozenset[str] = frozenset(cls.__struct_config__.tag for cls in ALL_EVENTS)  # type: ignore[misc]

MAX_LIST_ITEMS = 4  # a list field shows this many items, then "…+N"
MAX_STRING = 160  # longer strings are cut with "…"
_ACTOR_WIDTH = 16
_TYPE_WIDTH = 13  # PREFILL_CHUNK, STEP_FINISHED

_RESET = "\x1b[0m"
_DIM = "\x1b[2m"
_GROUP_COLORS = {"REQUEST": "\x1b[36m", "KV": "\x1b[35m", "WORKER": "\x1b[34m", "ACTOR": "\x1b[1m"}
_TYPE_COLORS = {
    "FINISHED": "\x1b[32m",
    "ABORTED": "\x1b[33m",
    "PREEMPTED": "\x1b[33m",
    "CRASHED": "\x1b[1;31m",
    "HEARTBEAT": "\x1b[2m",
}
_GAP_COLOR = "\x1b[1;33m"
_GROUP_OF = {tag: group for group, tags in EVENT_GROUPS.items() for tag in tags}


def resolve_types(names: Iterable[str]) -> frozenset[str]:
    """Event type tags named by ``names`` (case-insensitive; group names expand); raises
    ``ValueError`` naming what it does not know."""
    resolved: set[str] = set()
    unknown: list[str] = []
    for name in names:
        key = name.strip().upper()
        group = EVENT_GROUPS.get(key) or EVENT_GROUPS.get(key.removesuffix("S"))
        if group is not None:
            resolved |= group
        elif key in ALL_EVENT_TYPES:
            resolved.add(key)
        else:
            unknown.append(name)
    if unknown:
        known = ", ".join(sorted(EVENT_GROUPS) + sorted(ALL_EVENT_TYPES))
        raise ValueError(f"unknown event type(s) {', '.join(unknown)}; known: {known}")
    return frozenset(resolved)


def event_request_ids(event: Event) -> list[str]:
    """The requests an event concerns (none for worker and lifecycle events)."""
    if isinstance(event, Tokens):
        return event.request_ids
    request_id = getattr(event, "request_id", None)
    return [request_id] if isinstance(request_id, str) else []


@dataclass
class TapFilter:
    """Which events a tap shows; a field left None lets everything through.

    ``types``: event tags or groups (REQUEST, KV, WORKER, ACTOR), case-insensitive.
    ``actors``: actor ids; shell-style patterns such as ``worker-*`` allowed.
    ``request_ids``: an event matches when it concerns one of them - any id a TOKENS event lists,
    and a child ``"r#i"`` matches ``"r"``.
    ``replicas``: replica indices; an event matches when its actor belongs to one of them
    (``scheduler@1``; the bare names of a one-replica group are replica 0) or it is a ROUTED
    event sending a request to one of them.
    """

    types: set[str] | None = None
    actors: set[str] | None = None
    request_ids: set[str] | None = None
    replicas: set[int] | None = None
    _types: frozenset[str] | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self._types = None if self.types is None else resolve_types(self.types)

    def matches_actor(self, actor: str) -> bool:
        if self.actors is None:
            return True
        return actor in self.actors or any(fnmatch.fnmatchcase(actor, pattern) for pattern in self.actors)

    def matches_request(self, request_id: str) -> bool:
        wanted = self.request_ids
        return wanted is None or request_id in wanted or parent_request_id(request_id) in wanted

    def matches(self, actor: str, event: Event) -> bool:
        if self._types is not None and event_type(event) not in self._types:
            return False
        if not self.matches_actor(actor):
            return False
        if self.replicas is not None and replica_of(actor) not in self.replicas \
                and not (isinstance(event, Routed) and event.replica in self.replicas):
            return False
        if self.request_ids is None:
            return True
        return any(self.matches_request(request_id) for request_id in event_request_ids(event))


class GapTracker:
    """Per actor, the next expected sequence number (the metrics store's rules: the first batch of
    an actor sets the baseline, a restart at seq 0 sets a new one)."""

    def __init__(self) -> None:
        self._sequences = SequenceTracker()
        self.missed: dict[str, int] = {}  # events missed so far, per actor

    def observe(self, batch: EventBatch) -> int:
        """The number of events of ``batch.actor`` missed just before this batch."""
        check = self._sequences.check(batch)
        if check.verdict is not SeqVerdict.GAP:
            return 0
        self.missed[batch.actor] = self.missed.get(batch.actor, 0) + check.missed
        return check.missed


# --------------------------------------------------------------------------- formatting
def _clock(wall: float) -> str:
    moment = datetime.datetime.fromtimestamp(wall)
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def _short_string(text: str) -> str:
    return text if len(text) <= MAX_STRING else text[: MAX_STRING - 1] + "…"


def _format_scalar(value: Any) -> str:
    if isinstance(value, str):
        text = _short_string(value)
        if not text or any(char.isspace() or char in "\"'=" for char in text):
            return msgspec.json.encode(text).decode()
        return text
    if isinstance(value, float):
        return f"{value:.3f}"
    if value is None:
        return "-"
    return str(value)


def _format_list(values: list[Any]) -> str:
    shown = ",".join(_format_scalar(value) for value in values[:MAX_LIST_ITEMS])
    more = len(values) - MAX_LIST_ITEMS
    return f"[{shown},…+{more}]" if more > 0 else f"[{shown}]"


def _format_value(value: Any) -> str:
    return _format_list(value) if isinstance(value, list) else _format_scalar(value)


def event_fields(event: Event) -> str:
    """``key=value`` pairs of an event, compact: lists cut after a few items, TOKENS paired up,
    optional fields left unset (None by default and None here) not shown."""
    if isinstance(event, Tokens):
        counts = event.num_output_tokens
        pairs = [f"{request_id}:{counts[index] if index < len(counts) else '?'}"
                 for index, request_id in enumerate(event.request_ids)]
        more = len(pairs) - MAX_LIST_ITEMS
        shown = " ".join(_format_scalar(pair) for pair in pairs[:MAX_LIST_ITEMS])
        return f"step_id={event.step_id} n={len(event.request_ids)} out=[{shown}{f' …+{more}' if more > 0 else ''}]"
    fields = msgspec.to_builtins(event)
    fields.pop("type", None)
    unset = {field.name for field in msgspec.structs.fields(event)
             if field.default is None and getattr(event, field.name) is None}
    return " ".join(f"{key}={_format_value(value)}" for key, value in fields.items() if key not in unset)


def _type_color(kind: str) -> str:
    return _TYPE_COLORS.get(kind) or _GROUP_COLORS.get(_GROUP_OF.get(kind, ""), "")


def format_event(actor: str, seq: int, wall: float, event: Event, color: bool) -> str:
    """One line: ``HH:MM:SS.mmm actor #seq TYPE key=value ...`` (ANSI colours by kind if asked)."""
    kind = event_type(event)
    clock = _clock(wall)
    fields = event_fields(event)
    label = f"{kind:<{_TYPE_WIDTH}}"
    if color:
        clock = f"{_DIM}{clock}{_RESET}"
        label = f"{_type_color(kind)}{label}{_RESET}"
        if isinstance(event, ActorCrashed):
            fields = f"{_TYPE_COLORS['CRASHED']}{fields}{_RESET}"
    return f"{clock} {actor:<{_ACTOR_WIDTH}} #{seq:<7} {label} {fields}".rstrip()


def format_event_json(actor: str, seq: int, mono: float, wall: float, event: Event) -> str:
    """One JSON object: ``{"actor", "seq", "mono", "wall", "type", ...fields}`` (the dump's format)."""
    return event_json_line(actor, seq, mono, wall, event)


def format_gap(actor: str, missed: int, color: bool) -> str:
    text = f"--- {actor}: {missed} event{'s' if missed != 1 else ''} missed ---"
    return f"{_GAP_COLOR}{text}{_RESET}" if color else text


def format_gap_json(actor: str, missed: int) -> str:
    return msgspec.json.encode({"actor": actor, "type": "GAP", "missed": missed}).decode()


def _narrowed(event: Event, tap_filter: TapFilter) -> Event:
    """A TOKENS event cut down to the requests the filter asks for (others pass unchanged)."""
    if tap_filter.request_ids is None or not isinstance(event, Tokens):
        return event
    keep = [index for index, request_id in enumerate(event.request_ids) if tap_filter.matches_request(request_id)]
    counts = event.num_output_tokens
    return Tokens(step_id=event.step_id, request_ids=[event.request_ids[index] for index in keep],
                  num_output_tokens=[counts[index] for index in keep if index < len(counts)])


def render_batch(batch: EventBatch, tap_filter: TapFilter | None, gaps: GapTracker, color: bool,
                 as_json: bool) -> list[str]:
    """The lines a tap prints for one batch: a gap line first when events were missed (unless the
    filter leaves the actor out), then each matching event."""
    tap_filter = tap_filter or TapFilter()
    lines: list[str] = []
    missed = gaps.observe(batch)
    if not tap_filter.matches_actor(batch.actor):
        return lines
    if missed:
        lines.append(format_gap_json(batch.actor, missed) if as_json else format_gap(batch.actor, missed, color))
    for seq, event in stamped(batch):
        if not tap_filter.matches(batch.actor, event):
            continue
        event = _narrowed(event, tap_filter)
        if as_json:
            lines.append(format_event_json(batch.actor, seq, batch.mono, batch.wall, event))
        else:
            lines.append(format_event(batch.actor, seq, batch.wall, event, color))
    return lines
