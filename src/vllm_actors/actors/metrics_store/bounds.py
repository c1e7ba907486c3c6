"""What the store keeps of one event, bounded: strings capped, and a cheap estimate of its size.

Whatever a client puts in an event (a 60 KB request id, a long abort reason) would otherwise be
copied into every event that names it and kept in the event log and the request timelines. So
every event is bounded on arrival (``bounded``): a request id (or actor id) longer than
``MAX_ID_CHARS`` becomes its first characters, ``~`` and a digest of the whole (so two long ids
stay distinct, and every event of one request still maps to one record), keeping an n>1 child's
``#<index>`` suffix so the parent -> children index still holds; any other text longer than
``MAX_TEXT_CHARS`` is cut, saying how much. ``event_bytes`` estimates what a retained event costs
(object headers, strings, lists), enough for byte budgets; it is not ``sys.getsizeof``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec

from vllm_actors.protocol.events import ALL_EVENTS, Event, Tokens
from vllm_actors.protocol.names import CHILD_SEPARATOR

MAX_ID_CHARS = 256
MAX_TEXT_CHARS = 512
_SHORTEST_CAP = min(MAX_ID_CHARS, MAX_TEXT_CHARS)  # text up to this long is never capped
_DIGEST_CHARS = 16  # hex digits of the digest that keeps capped ids apart
_MAX_CHILD_SUFFIX = 9  # "#<index>" kept as is up to this many digits

# Rough CPython costs, in bytes: an object header with its slots, a str (ASCII) header, a list
# header and its slot, a boxed int or float.
_STRUCT_HEADER = 48
_SLOT = 8
_STR_HEADER = 49
_LIST_HEADER = 56
_NUMBER = 32


def cap_id(value: str) -> str:
    """``value`` if at most ``MAX_ID_CHARS`` long, else a shorter id that stands for it alone (an
    n>1 child ``"<id>#<k>"`` becomes ``cap_id("<id>") + "#<k>"``: its parent's capped id)."""
    if len(value) <= MAX_ID_CHARS:
        return value
    head, separator, index = value.rpartition(CHILD_SEPARATOR)
    if separator and index.isdigit() and len(index) <= _MAX_CHILD_SUFFIX:
        return f"{_digested(head)}{CHILD_SEPARATOR}{index}"
    return _digested(value)


def _digested(value: str) -> str:
    if len(value) <= MAX_ID_CHARS:
        return value
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=_DIGEST_CHARS // 2).hexdigest()
    return f"{value[:MAX_ID_CHARS - _DIGEST_CHARS - 1]}~{digest}"


def cap_text(value: str) -> str:
    """``value`` cut to ``MAX_TEXT_CHARS``, saying how much was cut."""
    if len(value) <= MAX_TEXT_CHARS:
        return value
    return f"{value[:MAX_TEXT_CHARS]}...(+{len(value) - MAX_TEXT_CHARS} chars)"


def _cap_ids(values: list[str]) -> list[str]:
    return [cap_id(value) for value in values]


def _capper(name: str, kind: Any) -> Callable[[Any], Any] | None:
    if "list" in repr(kind):  # TOKENS' request ids: ``bounded``'s own path
        return None
    if kind is str or "str" in repr(kind):  # str, or a union holding str (``stop_reason``)
        return cap_id if name in ("request_id", "actor") else cap_text
    return None


def _fields(cls: type[msgspec.Struct]) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    fields: list[tuple[str, Callable[[Any], Any]]] = []
    for info in msgspec.structs.fields(cls):
        capper = _capper(info.name, info.type)
        if capper is not None:
            fields.append((info.name, capper))
    return tuple(fields)


# Per event type: its fields that may hold text, each with how it is capped.
_TEXT_FIELDS: dict[type, tuple[tuple[str, Callable[[Any], Any]], ...]] = {cls: _fields(cls) for cls in ALL_EVENTS}


def bounded(event: Event) -> Event:
    """The event itself when none of its text is over the caps (the usual case: no copy), else a
    copy with its text capped (``cap_id`` for ids, ``cap_text`` for the rest)."""
    if type(event) is Tokens:  # the hot path: one per step
        ids = event.request_ids
        if not ids or max(map(len, ids)) <= MAX_ID_CHARS:
            return event
        return msgspec.structs.replace(event, request_ids=_cap_ids(ids))
    fields = _TEXT_FIELDS.get(type(event), ())
    changes: dict[str, Any] = {}
    for name, capper in fields:
        value = getattr(event, name)
        if isinstance(value, str) and len(value) > _SHORTEST_CAP:
            capped = capper(value)
            if capped is not value:
                changes[name] = capped
    return msgspec.structs.replace(event, **changes) if changes else event


MAX_COUNTED_KEYS = 64  # distinct reasons (or actors) a counter table keeps; the rest count as "other"


def count_into(counts: dict[str, int], key: str) -> None:
    """One more of ``key`` (capped) in ``counts``: past ``MAX_COUNTED_KEYS`` keys, new ones count
    under "other" (a client chooses its abort reasons)."""
    key = cap_text(key)
    if key not in counts and len(counts) >= MAX_COUNTED_KEYS:
        key = "other"
    counts[key] = counts.get(key, 0) + 1


# --------------------------------------------------------------------------- sizes
def _sizer(cls: type[msgspec.Struct]) -> tuple[int, tuple[str, ...]]:
    infos = msgspec.structs.fields(cls)
    fixed = _STRUCT_HEADER + _SLOT * len(infos) + _NUMBER * len(infos)
    variable = tuple(info.name for info in infos if "str" in repr(info.type) or "list" in repr(info.type))
    return fixed, variable


_SIZES: dict[type, tuple[int, tuple[str, ...]]] = {cls: _sizer(cls) for cls in ALL_EVENTS}


def value_bytes(value: Any) -> int:
    """Estimated bytes of a str, a list of str or of numbers, or a number."""
    if isinstance(value, str):
        return _STR_HEADER + len(value)
    if isinstance(value, list):
        if value and isinstance(value[0], str):
            return _LIST_HEADER + (_SLOT + _STR_HEADER) * len(value) + sum(map(len, value))
        return _LIST_HEADER + (_SLOT + _NUMBER) * len(value)
    return _NUMBER


def event_bytes(event: Event) -> int:
    """Estimated bytes an event holds (its own object, its strings and lists)."""
    fixed, variable = _SIZES.get(type(event), (_STRUCT_HEADER, ()))
    return fixed + sum(value_bytes(getattr(event, name)) for name in variable)
