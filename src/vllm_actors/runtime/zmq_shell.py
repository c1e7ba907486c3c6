"""The thin ZMQ shell that runs one actor's state machine in its own process.

Sockets: a ROUTER bound at the actor's address receives commands ([sender identity, payload]);
one DEALER per peer (identity = this actor's id) sends to the peers' ROUTERs; a PUB connected to
the bus publishes one ``EventBatch`` per handled message. Frames are decoded strictly: a frame
that does not decode, a message type this actor does not take, or one from a sender that may not
send it, is logged and dropped; a message the state machine rejects (``MessageRejected``: it
failed validation, nothing changed) likewise, with a ``REJECTED`` event on the bus. Requests and
aborts from clients are screened first for request identity (``actors/scheduler/owners.py``: each
client connection owns its request ids; a refused ``AddRequest`` is answered to its sender only). The actor
never dies of a peer's or client's mistake. Any other exception out of the state machine is a bug:
the shell publishes ``CRASHED`` and lets it propagate (the process exits non-zero; let it crash).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import zmq

from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.events import DISABLE_EVENTS_ENV, WORK_EVENTS, ActorCrashed, EventBatch, Rejected
from vllm_actors.protocol.messages import RequestUpdates, StepResult
from vllm_actors.protocol.names import FRONTEND
from vllm_actors.runtime.security import GroupKeys, bind, connect
from vllm_actors.runtime.transport import Actor, EventStamper, split_events

if TYPE_CHECKING:
    from vllm_actors.runtime.run_dir import GroupAddresses

log = structlog.get_logger(__name__)

EVENT_HWM = 100_000  # event batches queued per subscriber before the bus drops (a visible gap)
COMMAND_HWM = 100_000

# Which senders may send which message type to an actor; None means any sender (clients).
AcceptRules = Mapping[type, frozenset[bytes] | None]


class EventPublisher:
    """PUB socket to the bus; stamps and sends one batch per call. Topic = actor id.

    ``bus_in`` is the bus endpoint to publish on: an engine actor's or the supervisor's own
    (``for_actor``: the bus forwards only its own topic from there), or the clients' shared one
    (which forwards no engine actor's id)."""

    @classmethod
    def for_actor(cls, context: zmq.Context, addresses: GroupAddresses, actor_id: str,
                  keys: GroupKeys | None = None) -> EventPublisher:
        """A publisher on ``actor_id``'s own bus endpoint (the clients' one when it has none)."""
        return cls(context, addresses.publish_address(actor_id), actor_id, keys=keys)

    def __init__(self, context: zmq.Context, bus_in: str, actor_id: str, *, keys: GroupKeys | None = None) -> None:
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, EVENT_HWM)
        self.socket.setsockopt(zmq.LINGER, 1000)
        connect(self.socket, bus_in, keys)
        self.stamper = EventStamper(actor_id)
        self._topic = actor_id.encode()
        self._encoder = msgspec.msgpack.Encoder()
        # The cost-of-events switch (protocol.events.DISABLE_EVENTS_ENV): work events are dropped here.
        self._drop_work_events = os.environ.get(DISABLE_EVENTS_ENV, "") not in ("", "0")

    def publish(self, events: list[Any]) -> EventBatch | None:
        if self._drop_work_events:
            events = [event for event in events if not isinstance(event, WORK_EVENTS)]
        if not events:
            return None
        batch = self.stamper.stamp(events)
        self.socket.send_multipart([self._topic, self._encoder.encode(batch)])
        return batch

    def close(self) -> None:
        self.socket.close()


class ZmqEndpoint:
    """An actor's command sockets, with the in-memory endpoint's interface: a ROUTER bound at
    ``inbox`` receives; ``send(peer_name, message)`` goes out through a DEALER to every address of
    that peer (several workers all get the plan); ``send(client_identity_bytes, message)`` replies
    through the ROUTER. ``recv`` returns the next well-formed message and sets ``last_sender``;
    malformed frames are logged, counted and dropped. ``codec`` decodes what arrives (default: the
    protocol types; an actor's ``MessageCodec.for_actor`` may decode some as views). ``keys``: the
    group's CURVE keys, for TCP endpoints (``runtime/security.py``)."""

    def __init__(
        self,
        context: zmq.Context,
        name: str,
        inbox: str,
        peers: Mapping[str, list[str]],
        codec: MessageCodec | None = None,
        *,
        keys: GroupKeys | None = None,
        peer_keys: Mapping[str, GroupKeys] | None = None,
    ) -> None:
        self.name = name
        self.keys = keys
        # Peers of another group (a Ray-placed replica's scheduler): that group's keys, per peer.
        self.peer_keys = dict(peer_keys or {})
        self.codec = codec or MessageCodec()
        self.num_dropped = 0
        self.last_sender = b""
        self.router = context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, COMMAND_HWM)
        self.router.setsockopt(zmq.SNDHWM, COMMAND_HWM)
        self.router.setsockopt(zmq.LINGER, 0)
        # A restarted peer reconnects under the same identity (its actor id) while this socket may
        # still hold the dead one's pipe: hand the identity over to the new connection. Without
        # this ZMQ keeps the old pipe and silently drops everything the new peer sends (a restarted
        # KV-cache manager's reset plan never reached the worker).
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        bind(self.router, inbox, keys)
        self.peers: dict[str, list[zmq.Socket]] = {}
        for peer, addresses in peers.items():
            self.peers[peer] = [self._dealer(context, address, self.peer_keys.get(peer, keys)) for address in addresses]

    def _dealer(self, context: zmq.Context, address: str, keys: GroupKeys | None) -> zmq.Socket:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self.name.encode())
        dealer.setsockopt(zmq.SNDHWM, COMMAND_HWM)
        dealer.setsockopt(zmq.LINGER, 0)
        connect(dealer, address, keys)
        return dealer

    def replace_peer(self, peer: str, address: str, keys: GroupKeys | None) -> zmq.Socket:
        """A peer moved (a Ray-placed replica restarted elsewhere): close its DEALER, whose queue
        waits for an endpoint that is gone, and connect a new one; returns it."""
        for socket in self.peers.get(peer, []):
            socket.close()
        if keys is not None:
            self.peer_keys[peer] = keys
        dealer = self._dealer(self.router.context, address, self.peer_keys.get(peer, self.keys))
        self.peers[peer] = [dealer]
        return dealer

    def send(self, destination: str | bytes, message: Any) -> None:
        payload = self.codec.encode(message)
        if isinstance(destination, bytes):
            self.router.send_multipart([destination, payload])
            return
        sockets = self.peers.get(destination)
        if not sockets:
            raise KeyError(f"no endpoint named {destination!r}")
        for socket in sockets:
            socket.send(payload, copy=False)

    def recv(self, timeout_ms: int = 0) -> Any | None:
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            remaining = max(int((deadline - time.monotonic()) * 1000), 0)
            if not self.router.poll(remaining):
                return None
            frames = self.router.recv_multipart()
            if len(frames) != 2:
                self.drop("wrong frame count", sender=frames[0] if frames else b"", frames=len(frames))
                continue
            sender, payload = frames
            try:
                message = self.codec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                self.drop("undecodable frame", sender=sender, size=len(payload), error=str(error))
                continue
            self.last_sender = sender
            return message

    def drop(self, why: str, sender: bytes, **fields: object) -> None:
        self.num_dropped += 1
        log.warning("frame dropped", actor=self.name, why=why, sender=sender[:64], **fields)

    def close(self) -> None:
        for sockets in self.peers.values():
            for socket in sockets:
                socket.close()
        self.router.close()


class ActorShell:
    """Receive, check who may send what, handle, send, publish: the whole actor loop."""

    def __init__(
        self,
        context: zmq.Context,
        actor: Actor,
        actor_id: str,
        inbox: str,
        bus_in: str,
        peers: Mapping[str, list[str]],
        accepts: AcceptRules,
        codec: MessageCodec | None = None,
        *,
        keys: GroupKeys | None = None,
        peer_keys: Mapping[str, GroupKeys] | None = None,
    ) -> None:
        self.actor = actor
        self.actor_id = actor_id
        self.accepts = accepts
        self.endpoint = ZmqEndpoint(context, actor_id, inbox, peers, codec, keys=keys, peer_keys=peer_keys)
        self.publisher = EventPublisher(context, bus_in, actor_id, keys=keys)
        # Which client connection owns which request (the scheduler's clients): see owners.py.
        self.owners = RequestOwners()
        self.busy_since: float | None = None  # time.monotonic() when the message in hand arrived
        # Poll without blocking for this long after a message (runtime/busy_poll.py; 0: always block).
        self.busy_poll_s = 0.0
        self._last_message_at = 0.0

    def busy_seconds(self) -> float:
        """How long the message in hand has taken so far (0 when idle): the liveness pings' ``busy``."""
        since = self.busy_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def num_dropped(self) -> int:
        return self.endpoint.num_dropped

    def run(self, stop: threading.Event) -> None:
        """Serve until ``stop``; a bug anywhere in the loop publishes CRASHED and propagates."""
        try:
            while not stop.is_set():
                message = self._next_message()
                if message is not None:
                    self.busy_since = time.monotonic()
                    try:
                        self.receive(self.endpoint.last_sender, message)
                    finally:
                        self.busy_since = None
        except Exception as error:
            self.publisher.publish([ActorCrashed(error=f"{type(error).__name__}: {error}")])
            raise

    def _next_message(self) -> Any | None:
        """The next message; meanwhile, a step the actor launched and has not read back (a
        worker's deferred step) is flushed as soon as it is done and no message waits, so the
        next plan, when it comes first, is launched before the previous step is read back."""
        has_pending = getattr(self.actor, "has_pending", None)
        if has_pending is None or not has_pending():
            if self.busy_poll_s and time.monotonic() - self._last_message_at < self.busy_poll_s:
                message = self.endpoint.recv(timeout_ms=0)  # busy: look again at once (busy_poll.py)
                if message is None:
                    time.sleep(0)
                    return None
            else:
                message = self.endpoint.recv(timeout_ms=100)
            if message is not None:
                self._last_message_at = time.monotonic()
            return message
        while True:
            message = self.endpoint.recv(timeout_ms=0)
            if message is not None:
                self._last_message_at = time.monotonic()
                return message
            if self.actor.pending_ready():  # type: ignore[attr-defined]
                self.dispatch(self.actor.flush())  # type: ignore[attr-defined]
                return None
            time.sleep(0)  # the GPU is busy with the step: let other threads run, look again

    def receive(self, sender: bytes, message: Any) -> None:
        kind = self.endpoint.codec.protocol_type(message)
        if kind not in self.accepts:
            self.endpoint.drop("message type not taken here", sender=sender, type=kind.__name__)
            return
        allowed = self.accepts[kind]
        if allowed is not None and sender not in allowed:
            self.endpoint.drop("sender may not send this", sender=sender, type=kind.__name__)
            return
        message, refusal = self.owners.screen(sender, message)  # identity: ids owned per connection
        if refusal is not None:
            self.refuse(sender, kind.__name__, refusal.error, "refused: request identity", message)
            if refusal.reply is not None:
                self.endpoint.send(sender, refusal.reply)  # to the sender only
        if message is None:
            return
        try:
            outputs = self.actor.handle(message)
        except MessageRejected as error:  # anything else is a bug: it propagates, the actor crashes
            self.refuse(sender, kind.__name__, str(error), "rejected by the state machine", message)
            return
        self.owners.observe(sender, message)
        self.dispatch(outputs)

    def refuse(self, sender: bytes, message_type: str, error: str, why: str, message: Any = None) -> None:
        """Log and publish (``REJECTED``) a message refused whole or in part; nothing changed."""
        self.endpoint.drop(why, sender=sender, type=message_type, error=error, **_request_of(message))
        self.publisher.publish(
            [Rejected(message_type=message_type, sender=sender[:64].decode(errors="replace"), error=error)]
        )

    def dispatch(self, outputs: list[tuple[str, Any]]) -> None:
        messages, events = split_events(outputs)
        for destination, message in messages:
            stamp_departure(message)
            if destination == FRONTEND and isinstance(message, RequestUpdates):
                for owner, updates in self.owners.split(message).items():
                    self.endpoint.send(owner, updates)
                continue
            try:
                self.endpoint.send(destination, message)
            except KeyError:
                log.error("no route", actor=self.actor_id, destination=destination)
        self.publisher.publish(events)

    def close(self) -> None:
        self.endpoint.close()
        self.publisher.close()


def stamp_departure(message: Any) -> None:
    """A step result's and a scheduler's updates' departure time, once (a controller forwarding a
    replica's updates keeps the replica's): the edge stamps, the state machines hold no clock."""
    if isinstance(message, StepResult) and not message.finished_at:
        message.finished_at = time.monotonic()
    elif isinstance(message, RequestUpdates) and not message.sent_at:
        message.sent_at = time.monotonic()


def _request_of(message: Any) -> dict[str, object]:
    """The request id a message names, for its log line (none: no field)."""
    request_id = getattr(message, "request_id", None)
    if isinstance(request_id, str):
        return {"request_id": request_id}
    request_ids = getattr(message, "request_ids", None)
    return {"request_ids": request_ids[:8]} if isinstance(request_ids, list) and request_ids else {}


def wait_until_seen(
    publisher: EventPublisher,
    context: zmq.Context,
    metrics_address: str,
    actor_id: str,
    timeout: float,
    make_event: Callable[[], Any],
    keys: GroupKeys | None = None,
) -> None:
    """Publish until the metrics store reports having seen this actor (PUB/SUB drops what is sent
    before the subscription reaches the publisher: the slow-joiner problem)."""
    from vllm_actors.protocol.metrics import MetricsCodec, SeenQuery

    codec = MetricsCodec()

    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    connect(dealer, metrics_address, keys)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            publisher.publish([make_event()])
            dealer.send(codec.encode(SeenQuery(actor=actor_id)))
            if dealer.poll(200):
                reply = codec.decode_reply(dealer.recv())
                seen = getattr(reply, "actors", {}).get(actor_id)
                if seen is not None and seen.num_events > 0:
                    return
            time.sleep(0.02)
        raise TimeoutError(f"the metrics store did not see {actor_id}'s events within {timeout:.0f} s")
    finally:
        dealer.close()
