"""The event bus: XSUB endpoints in, one XPUB out, and a check of who publishes under which id.

Each engine actor and the supervisor publish on an XSUB endpoint of their own
(``GroupAddresses.bus_in_actors``); clients share ``bus_in``. The bus forwards a batch only when
its topic (the publisher's actor id) is the owner of the endpoint it came in on; on the clients'
endpoint, only topics that are no engine actor's id (``names.is_engine_actor``). Anything else -
a forged topic, a frame count other than two - is dropped, counted and logged (at most one line
per endpoint and topic every ``DROP_LOG_SECONDS``). Subscriptions flow the other way: from the
XPUB to every XSUB, so publishers filter at the source as with a plain proxy.

The topic is all the bus reads (it never decodes a batch); the metrics store checks that the
batch inside names the same actor. Binding an ``ipc://`` endpoint replaces a socket file left by
a bus that was killed, so a restarted bus rebinds the same paths.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import structlog
import zmq

from vllm_actors.protocol.names import is_engine_actor
from vllm_actors.runtime import signal_wake
from vllm_actors.runtime.process import ActorSpec, report
from vllm_actors.runtime.security import GroupKeys, bind
from vllm_actors.runtime.zmq_shell import EVENT_HWM

log = structlog.get_logger(__name__)

DROP_LOG_SECONDS = 5.0
MAX_BATCHES_PER_TURN = 1_000  # per endpoint and poll: no publisher starves the others

CLIENTS = "clients"  # how the log names the shared endpoint


def topic_allowed(owner: str | None, topic: bytes) -> bool:
    """Whether a batch under ``topic`` may come in on the endpoint of ``owner`` (None: the clients')."""
    if owner is not None:
        return topic == owner.encode()
    try:
        actor = topic.decode()
    except UnicodeDecodeError:
        return False
    return bool(actor) and not is_engine_actor(actor)


@dataclass
class DropCounter:
    """Dropped batches per (endpoint, topic): counted always, logged at most once per interval."""

    interval: float = DROP_LOG_SECONDS
    total: int = 0
    by_source: dict[tuple[str, str], int] = field(default_factory=dict)
    _unlogged: dict[tuple[str, str], int] = field(default_factory=dict)
    _last_log: dict[tuple[str, str], float] = field(default_factory=dict)

    def drop(self, endpoint: str, topic: bytes, why: str, now: float) -> bool:
        """Count one dropped batch; log it (with the count since the last line) unless this
        endpoint and topic were logged less than ``interval`` ago. True when logged."""
        key = (endpoint, topic[:64].decode(errors="replace"))
        self.total += 1
        self.by_source[key] = self.by_source.get(key, 0) + 1
        self._unlogged[key] = self._unlogged.get(key, 0) + 1
        last = self._last_log.get(key)
        if last is not None and now - last < self.interval:
            return False
        self._last_log[key] = now
        count = self._unlogged.pop(key)
        log.warning("event batch dropped", endpoint=endpoint, topic=key[1], why=why, batches=count, total=self.total)
        return True


def _socket(context: zmq.Context, kind: int, address: str, keys: GroupKeys | None) -> zmq.Socket:
    socket = context.socket(kind)
    socket.setsockopt(zmq.SNDHWM, EVENT_HWM)
    socket.setsockopt(zmq.RCVHWM, EVENT_HWM)
    socket.setsockopt(zmq.LINGER, 0)
    bind(socket, address, keys)  # ipc: replaces a stale socket file
    return socket


class Bus:
    """The bus's sockets and its forwarding loop (``run_bus`` runs it as an actor process).
    ``keys``: the group's CURVE keys, for TCP endpoints (``runtime/security.py``)."""

    def __init__(self, context: zmq.Context, clients: str, owned: dict[str, str], out: str,
                 keys: GroupKeys | None = None) -> None:
        self.inputs: dict[zmq.Socket, str | None] = {_socket(context, zmq.XSUB, clients, keys): None}
        for owner, address in owned.items():
            self.inputs[_socket(context, zmq.XSUB, address, keys)] = owner
        self.output = _socket(context, zmq.XPUB, out, keys)
        self.drops = DropCounter()
        self.forwarded = 0

    def run(self, stop: threading.Event) -> None:
        poller = zmq.Poller()
        poller.register(self.output, zmq.POLLIN)
        for socket in self.inputs:
            poller.register(socket, zmq.POLLIN)
        signal_wake.watch(poller)
        while not stop.is_set():
            ready = dict(poller.poll(100))
            signal_wake.woke(ready)
            if self.output in ready:
                self._forward_subscriptions()
            for socket, owner in self.inputs.items():
                if socket in ready:
                    self._forward_batches(socket, owner)

    def _forward_subscriptions(self) -> None:
        while True:
            try:
                frame = self.output.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            for socket in self.inputs:
                socket.send(frame)

    def _forward_batches(self, socket: zmq.Socket, owner: str | None) -> None:
        for _ in range(MAX_BATCHES_PER_TURN):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            topic = frames[0].bytes
            if len(frames) != 2:
                self.drops.drop(owner or CLIENTS, topic, f"{len(frames)} frames", time.monotonic())
            elif not topic_allowed(owner, topic):
                why = "topic is not the endpoint's owner" if owner else "an engine actor's id on the clients' endpoint"
                self.drops.drop(owner or CLIENTS, topic, why, time.monotonic())
            else:
                self.output.send_multipart(frames, copy=False)
                self.forwarded += 1

    def close(self) -> None:
        sockets: Iterable[zmq.Socket] = [*self.inputs, self.output]
        for socket in sockets:
            socket.close()


def run_bus(spec: ActorSpec, context: zmq.Context, stop: threading.Event, keys: GroupKeys | None = None) -> None:
    """The event bus process: bind every endpoint, report ready, forward until ``stop``."""
    addresses = spec.addresses
    bus = Bus(context, addresses.bus_in, dict(addresses.bus_in_actors), addresses.bus_out,
              keys)
    report("ready", info={})
    try:
        bus.run(stop)
    finally:
        if bus.drops.total:
            log.warning("bus stopped", forwarded=bus.forwarded, dropped=bus.drops.total)
        bus.close()
