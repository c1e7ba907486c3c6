"""Transport between actors. Each actor owns an ``Endpoint``: ``send(destination, message)`` and
``recv()``, which also tells who sent what it returns (``last_sender``). The in-memory network here
drives the actors inside one process (tests, the offline engine); the ZMQ transport
(``zmq_shell.ZmqEndpoint``) offers the same calls across processes.

An actor is anything with a ``name`` and ``handle(message) -> Outputs``: a pure state machine.
Its loop (``runtime/loop.py``) is: receive, check who may send what, handle, send the messages,
publish the events as one stamped batch. An actor that launches work and reads it back later
declares it (``Deferring``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import structlog

from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import EventBatch
from vllm_actors.protocol.names import CLIENT
from vllm_actors.protocol.outputs import Outputs

log = structlog.get_logger(__name__)


class Actor(Protocol):
    name: str

    def handle(self, message: Any) -> Outputs: ...


@runtime_checkable
class Deferring(Protocol):
    """An actor that launches work and reads it back later (a worker's deferred steps): the loop
    reads it back (``flush``) once it is done and no message waits."""

    def has_pending(self) -> bool: ...

    def pending_ready(self) -> bool: ...

    def flush(self) -> Outputs: ...


class Endpoint(Protocol):
    name: str
    codec: MessageCodec
    last_sender: bytes  # who sent the message ``recv`` returned last
    num_dropped: int

    def send(self, destination: str | bytes, message: Any) -> None: ...

    def recv(self, timeout_ms: int = 0) -> Any | None: ...

    def drop(self, why: str, sender: bytes, **fields: object) -> None: ...


def log_drop(endpoint: str, why: str, sender: bytes, **fields: object) -> None:
    """The log line of a message or frame an endpoint drops."""
    log.warning("frame dropped", actor=endpoint, why=why, sender=sender[:64], **fields)


class InMemoryNetwork:
    """Queues between named endpoints in one process. With ``serialize=True`` every wire message
    makes a msgpack round trip, as it would between processes (client-bound outputs excepted),
    decoded as the receiving actor decodes it (``MessageCodec.for_actor``). Without, the actors
    get the live objects: state machines work with both. Each queued message keeps its sender's
    identity, as a ROUTER socket reads it."""

    def __init__(self, serialize: bool = False) -> None:
        self._inboxes: dict[str, deque[tuple[bytes, Any]]] = {}
        self._serialize = serialize
        self._codecs: dict[str, MessageCodec] = {}

    def endpoint(self, name: str, identity: str | None = None) -> InMemoryEndpoint:
        """The endpoint at address ``name``; what it sends comes from ``identity`` (default: its name)."""
        if name in self._inboxes:
            raise ValueError(f"endpoint {name!r} exists already")
        self._inboxes[name] = deque()
        codec = MessageCodec.for_actor(name)
        if self._serialize:
            self._codecs[name] = codec
        return InMemoryEndpoint(name, self, codec, identity or name)

    def inbox(self, name: str) -> deque[tuple[bytes, Any]]:
        """What waits for endpoint ``name``: (sender, message) pairs, oldest first."""
        return self._inboxes[name]

    def post(self, sender: bytes, destination: str, message: Any) -> None:
        inbox = self._inboxes.get(destination)
        if inbox is None:
            raise KeyError(f"no endpoint named {destination!r}")
        codec = self._codecs.get(destination)
        if codec is not None and destination != CLIENT:
            message = codec.decode(codec.encode(message))
        inbox.append((sender, message))

    def pending(self) -> int:
        return sum(len(inbox) for inbox in self._inboxes.values())


class InMemoryEndpoint:
    def __init__(self, name: str, network: InMemoryNetwork, codec: MessageCodec | None = None,
                 identity: str | None = None) -> None:
        self.name = name
        self.codec = codec or MessageCodec()
        self.identity = (identity or name).encode()
        self.last_sender = b""
        self.num_dropped = 0
        self._network = network

    def send(self, destination: str | bytes, message: Any) -> None:
        """To a named endpoint; bytes: to the endpoint of that identity (a reply, as a ROUTER's)."""
        name = destination.decode() if isinstance(destination, bytes) else destination
        self._network.post(self.identity, name, message)

    def recv(self, timeout_ms: int = 0) -> Any | None:
        """The next message, or None (in one process nothing can arrive while we wait)."""
        inbox = self._network.inbox(self.name)
        if not inbox:
            return None
        self.last_sender, message = inbox.popleft()
        return message

    def drop(self, why: str, sender: bytes, **fields: object) -> None:
        self.num_dropped += 1
        log_drop(self.name, why, sender, **fields)


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
