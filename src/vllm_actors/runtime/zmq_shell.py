"""The thin ZMQ shell that runs one actor's state machine in its own process.

Sockets: a ROUTER bound at the actor's address receives commands ([sender identity, payload]);
one DEALER per peer (identity = this actor's id) sends to the peers' ROUTERs; a PUB connected to
the bus publishes one ``EventBatch`` per handled message. Frames are decoded strictly: a frame
that does not decode is logged and dropped. What happens to a decoded message (who may send it,
request identity, rejections) is the loop's (``runtime/loop.py``), shared with the in-process
engine. The actor never dies of a peer's or client's mistake; any other exception out of the
state machine is a bug: the shell publishes ``CRASHED`` and lets it propagate (the process exits
non-zero; let it crash).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import WORK_EVENTS, ActorCrashed, EventBatch
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.runtime import signal_wake
from vllm_actors.runtime.loop import AcceptRules, ActorLoop
from vllm_actors.runtime.security import GroupKeys, bind, connect
from vllm_actors.runtime.transport import Actor, EventStamper, log_drop

if TYPE_CHECKING:
    from vllm_actors.runtime.run_dir import GroupAddresses

EVENT_HWM = 100_000  # event batches queued per subscriber before the bus drops (a visible gap)
COMMAND_HWM = 100_000


class EventPublisher:
    """PUB socket to the bus; stamps and sends one batch per call. Topic = actor id.

    ``bus_in`` is the bus endpoint to publish on: an engine actor's or the supervisor's own
    (``for_actor``: the bus forwards only its own topic from there), or the clients' shared one
    (which forwards no engine actor's id). ``drop_work_events``: work events (``WORK_EVENTS``) are
    dropped here, to measure what publishing them costs."""

    @classmethod
    def for_actor(cls, context: zmq.Context, addresses: GroupAddresses, actor_id: str,
                  keys: GroupKeys | None = None, *, drop_work_events: bool = False) -> EventPublisher:
        """A publisher on ``actor_id``'s own bus endpoint (the clients' one when it has none)."""
        return cls(context, addresses.publish_address(actor_id), actor_id, keys=keys,
                   drop_work_events=drop_work_events)

    def __init__(self, context: zmq.Context, bus_in: str, actor_id: str, *, keys: GroupKeys | None = None,
                 drop_work_events: bool = False) -> None:
        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, EVENT_HWM)
        self.socket.setsockopt(zmq.LINGER, 1000)
        connect(self.socket, bus_in, keys)
        self.stamper = EventStamper(actor_id)
        self._topic = actor_id.encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._drop_work_events = drop_work_events

    def publish(self, events: list[Any]) -> EventBatch | None:
        if self._drop_work_events:
            events = [event for event in events if not isinstance(event, WORK_EVENTS)]
        if not events:
            return None
        batch = self.stamper.stamp(events)
        self.resend(batch)
        return batch

    def resend(self, batch: EventBatch) -> None:
        """Send an already stamped batch again (same sequence: the store skips a copy it has seen)."""
        self.socket.send_multipart([self._topic, self._encoder.encode(batch)])

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
        # A wait for a message also ends when the process gets a signal (its stop: signal_wake.py).
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        signal_wake.watch(self._poller)
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
            ready = dict(self._poller.poll(remaining))
            signal_wake.woke(ready)
            if self.router not in ready:
                return None  # the timeout, or a signal: the caller looks at its stop
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
        log_drop(self.name, why, sender, **fields)

    def close(self) -> None:
        for sockets in self.peers.values():
            for socket in sockets:
                socket.close()
        self.router.close()


class ActorShell:
    """The ZMQ side of the actor loop (``loop.ActorLoop``): when to look for the next message, how
    long the one in hand has taken, CRASHED on the bus when the loop fails."""

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
        owners: RequestOwners | None = None,
        drop_work_events: bool = False,
    ) -> None:
        self.actor = actor
        self.actor_id = actor_id
        self.endpoint = ZmqEndpoint(context, actor_id, inbox, peers, codec, keys=keys, peer_keys=peer_keys)
        publisher = EventPublisher(context, bus_in, actor_id, keys=keys, drop_work_events=drop_work_events)
        self.loop = ActorLoop(actor, self.endpoint, publisher, accepts, owners=owners)
        self.busy_since: float | None = None  # time.monotonic() when the message in hand arrived
        # Poll without blocking for this long after a message (runtime/busy_poll.py; 0: always block).
        self.busy_poll_s = 0.0
        self._last_message_at = 0.0

    @property
    def publisher(self) -> Any:
        """The loop's publisher (an ``EventPublisher``; tests put a recorder in its place)."""
        return self.loop.publisher

    @publisher.setter
    def publisher(self, publisher: Any) -> None:
        self.loop.publisher = publisher

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
        """The next message; meanwhile, work the actor launched and has not read back (a worker's
        deferred step) is flushed as soon as it is done and no message waits, so the next plan,
        when it comes first, is launched before the previous step is read back."""
        if not self.loop.has_pending():
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
            if self.loop.pending_ready():
                self.loop.flush()
                return None
            time.sleep(0)  # the GPU is busy with the step: let other threads run, look again

    def receive(self, sender: bytes, message: Any) -> None:
        self.loop.receive(sender, message)

    def dispatch(self, outputs: Outputs) -> None:
        self.loop.dispatch(outputs)

    def close(self) -> None:
        self.endpoint.close()
        self.publisher.close()


def wait_until_seen(
    publisher: EventPublisher,
    context: zmq.Context,
    metrics_address: str,
    actor_id: str,
    timeout: float,
    make_event: Callable[[], Any],
    keys: GroupKeys | None = None,
) -> None:
    """Publish one handshake until the metrics store reports having seen it (PUB/SUB drops what is
    sent before the subscription reaches the publisher: the slow-joiner problem). The same stamped
    batch is resent, so the lost copies leave no gap in the actor's sequence; and the store must
    have seen *its* sequence number, not just this actor: the events of an earlier socket (the
    start-up publisher's STARTING) prove nothing of this one's path."""
    from vllm_actors.protocol.metrics import MetricsCodec, SeenQuery

    codec = MetricsCodec()

    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    connect(dealer, metrics_address, keys)
    deadline = time.monotonic() + timeout
    handshake = publisher.stamper.stamp([make_event()])  # stamped once: every copy one sequence number
    try:
        while time.monotonic() < deadline:
            publisher.resend(handshake)
            dealer.send(codec.encode(SeenQuery(actor=actor_id)))
            if dealer.poll(200):
                reply = codec.decode_reply(dealer.recv())
                seen = getattr(reply, "actors", {}).get(actor_id)
                if seen is not None and seen.last_seq >= handshake.first_seq:
                    return
            time.sleep(0.02)
        raise TimeoutError(f"the metrics store did not see {actor_id}'s events within {timeout:.0f} s")
    finally:
        dealer.close()
