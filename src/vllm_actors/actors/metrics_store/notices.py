"""What the store has to say about the stream, as data: the shell logs these (the store has no logger).

Each notice names its log level and message; its fields are the log line's key-value pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class EventGap:
    """An actor's batch started past the expected sequence number: events were lost."""

    level: ClassVar[str] = "warning"
    message: ClassVar[str] = "event gap"
    actor: str
    missed: int
    first_seq: int


@dataclass(frozen=True, slots=True)
class StaleBatch:
    """An actor's batch started before the expected sequence number: its old events were skipped."""

    level: ClassVar[str] = "info"
    message: ClassVar[str] = "stale event batch"
    actor: str
    first_seq: int
    skipped: int


@dataclass(frozen=True, slots=True)
class ActorRestarted:
    """An actor's sequence started over: a new incarnation (what it held is gone)."""

    level: ClassVar[str] = "warning"
    message: ClassVar[str] = "actor restarted"
    actor: str
    first_seq: int


@dataclass(frozen=True, slots=True)
class OpenRequestDropped:
    """Too many open requests: the oldest one's record was dropped."""

    level: ClassVar[str] = "info"
    message: ClassVar[str] = "open request dropped"
    request_id: str
    state: str


@dataclass(frozen=True, slots=True)
class Untrusted:
    """A batch or events the store did not apply because their publisher may not publish them:
    a batch naming another actor than its bus topic, or a client publishing an engine event.
    Noticed on the 1st, 10th, 100th... time per (publisher, why); ``count`` says which."""

    level: ClassVar[str] = "warning"
    message: ClassVar[str] = "untrusted events dropped"
    publisher: str  # the bus topic (or the batch's actor without one)
    claimed: str  # the batch's actor
    why: str
    count: int


Notice = EventGap | StaleBatch | ActorRestarted | OpenRequestDropped | Untrusted
