"""Transport between actors. Each actor owns an ``Endpoint``: ``send(destination, message)`` and
``recv()``. The in-memory network here drives the actors inside one process (tests, the offline
engine); the ZMQ transport offers the same two calls across processes.

An actor is anything with a ``name`` and ``handle(message) -> [(destination, message), ...]``:
a pure state machine. Its loop is: receive, handle, send the messages, publish the events (those
addressed to ``BUS``) as one stamped batch.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import EventBatch
from vllm_actors.protocol.names import BUS, CLIENT


class Actor(Protocol):
    name: str

    def handle(self, message: Any) -> list[tuple[str, Any]]: ...


class Endpoint(Protocol):
    name: str

    def send(self, destination: str, message: Any) -> None: ...

    def recv(self, timeout_ms: int = 0) -> Any | None: ...


class InMemoryNetwork:
    """Queues between named endpoints in one process. With ``serialize=True`` every wire message
    makes a msgpack round trip, as it would between processes (client-bound outputs excepted),
    decoded as the receiving actor decodes it (``MessageCodec.for_actor``). Without, the actors
    get the live objects: state machines work with both."""

    def __init__(self, serialize: bool = False) -> None:
        self._inboxes: dict[str, deque[Any]] = {}
        self._serialize = serialize
        self._codecs: dict[str, MessageCodec] = {}

    def endpoint(self, name: str) -> InMemoryEndpoint:
        if name in self._inboxes:
            raise ValueError(f"endpoint {name!r} exists already")
        self._inboxes[name] = deque()
        if self._serialize:
            self._codecs[name] = MessageCodec.for_actor(name)
        return InMemoryEndpoint(name, self)

    def _post(self, destination: str, message: Any) -> None:
        inbox = self._inboxes.get(destination)
        if inbox is None:
            raise KeyError(f"no endpoint named {destination!r}")
        codec = self._codecs.get(destination)
        if codec is not None and destination != CLIENT:
            message = codec.decode(codec.encode(message))
        inbox.append(message)

    def _take(self, name: str) -> Any | None:
        inbox = self._inboxes[name]
        return inbox.popleft() if inbox else None

    def pending(self) -> int:
        return sum(len(inbox) for inbox in self._inboxes.values())


class InMemoryEndpoint:
    def __init__(self, name: str, network: InMemoryNetwork) -> None:
        self.name = name
        self._network = network

    def send(self, destination: str, message: Any) -> None:
        self._network._post(destination, message)

    def recv(self, timeout_ms: int = 0) -> Any | None:
        """The next message, or None (in one process nothing can arrive while we wait)."""
        return self._network._take(self.name)


class EventStamper:
    """Turns the events of one handling into one ``EventBatch``: actor id, clocks, sequence."""

    def __init__(
        self,
        actor: str,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.actor = actor
        self.next_seq = 0
        self._monotonic = monotonic
        self._wall = wall

    def stamp(self, events: list[Any]) -> EventBatch:
        batch = EventBatch(
            actor=self.actor, first_seq=self.next_seq, mono=self._monotonic(), wall=self._wall(), events=events
        )
        self.next_seq += len(events)
        return batch


def split_events(outputs: list[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], list[Any]]:
    """Separate an actor's outputs into messages to send and events for the bus."""
    messages = [(destination, message) for destination, message in outputs if destination != BUS]
    events = [message for destination, message in outputs if destination == BUS]
    return messages, events


def route_frontend_outputs(
    outputs: list[tuple[str, Any]], publish_events: Callable[[list[Any]], object]
) -> tuple[list[Any], list[tuple[str, Any]]]:
    """Publish the frontend's events first (ARRIVED happens before the scheduler hears of the
    request); return (outputs for the client, messages to send on)."""
    messages, events = split_events(outputs)
    if events:
        publish_events(events)
    client = [message for destination, message in messages if destination == CLIENT]
    onward = [(destination, message) for destination, message in messages if destination != CLIENT]
    return client, onward
