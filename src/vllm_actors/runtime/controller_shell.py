"""The replica-set controller's shell: the engine actors' shell (``zmq_shell.ActorShell``: the
clients' socket with its identity rules, one DEALER per replica scheduler, its events on the bus)
plus a SUB socket on the bus, from which it feeds the controller its replicas' KV-cache events and
the supervisor's failures and restarts (``Controller.observe``).

Events are taken before commands: whatever the bus delivered by the time a request is read is in
the cache mirror the request is routed by. Updates from a replica's scheduler reach the controller
with the replica they came from (``FromReplica``): each scheduler answers on the DEALER the
controller reached it through, one per replica, so the socket says which replica spoke.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import msgspec
import structlog
import zmq

from vllm_actors.actors.controller.controller import Controller, FromReplica
from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import EventBatch
from vllm_actors.protocol.messages import ReplicaState, RequestUpdates
from vllm_actors.protocol.names import (
    KV_CACHE_MANAGER,
    RAY_LAUNCHER,
    REPLICA_SEPARATOR,
    SCHEDULER,
    SUPERVISOR,
    replica_actor,
)
from vllm_actors.runtime import signal_wake
from vllm_actors.runtime.loop import AcceptRules
from vllm_actors.runtime.security import GroupKeys, attached_scheduler, connect
from vllm_actors.runtime.zmq_shell import EVENT_HWM, ActorShell

log = structlog.get_logger(__name__)

MAX_BATCHES_PER_TURN = 1_000


class ControllerShell(ActorShell):
    def __init__(self, context: zmq.Context, actor: Controller, actor_id: str, inbox: str, bus_in: str,
                 peers: Mapping[str, list[str]], accepts: AcceptRules, codec: MessageCodec | None = None, *,
                 keys: GroupKeys | None = None, owners: RequestOwners | None = None,
                 drop_work_events: bool = False, bus_out: str | None = None,
                 remote_replicas: list[str] | None = None) -> None:
        # Ray-placed replicas: each scheduler is reached with its own group's keys.
        self.remote_replicas = list(remote_replicas or [])
        peer_keys = {replica_actor(SCHEDULER, index): attached_scheduler(path)[1]
                     for index, path in enumerate(self.remote_replicas)}
        super().__init__(context, actor, actor_id, inbox, bus_in, peers, accepts, codec, keys=keys,
                         peer_keys=peer_keys, owners=owners, drop_work_events=drop_work_events)
        self.controller = actor
        self.events = context.socket(zmq.SUB)
        self.events.setsockopt(zmq.RCVHWM, EVENT_HWM)
        self.events.setsockopt(zmq.LINGER, 0)
        for topic in (f"{KV_CACHE_MANAGER}{REPLICA_SEPARATOR}", SUPERVISOR):
            self.events.setsockopt(zmq.SUBSCRIBE, topic.encode())
        if bus_out is not None:
            connect(self.events, bus_out, keys)
        self._decoder = msgspec.msgpack.Decoder(EventBatch)
        self._poller = zmq.Poller()
        self._poller.register(self.endpoint.router, zmq.POLLIN)
        self._poller.register(self.events, zmq.POLLIN)
        # Replica r's scheduler is peer "scheduler@r": its answers come back on that DEALER.
        self._names = [replica_actor(SCHEDULER, index) for index in range(len(self.endpoint.peers))]
        self._replicas = [self.endpoint.peers[name][0] for name in self._names]
        for dealer in self._replicas:
            self._poller.register(dealer, zmq.POLLIN)
        signal_wake.watch(self._poller)
        self.num_batches = 0

    def _next_message(self) -> Any | None:
        ready = dict(self._poller.poll(100))
        signal_wake.woke(ready)
        if self.events in ready:
            self._take_events()
        for replica, dealer in enumerate(self._replicas):
            if dealer in ready:
                self._take_updates(replica, dealer)
        router = self.endpoint.router
        if router in ready or router.get(zmq.EVENTS) & zmq.POLLIN:
            self._take_events()  # what arrived meanwhile counts for this request too
            return self.endpoint.recv(timeout_ms=0)
        return None

    def receive(self, sender: bytes, message: Any) -> None:
        if isinstance(message, ReplicaState) and message.up and sender == RAY_LAUNCHER.encode():
            self._reconnect(message.replica)
        super().receive(sender, message)

    def _reconnect(self, replica: int) -> None:
        """A Ray-placed replica serves again (its host restarted, on new endpoints): a new DEALER
        to its scheduler, from its attach directory, before the requests resent to it go out."""
        if not 0 <= replica < len(self.remote_replicas):
            return
        address, keys = attached_scheduler(self.remote_replicas[replica])
        old = self._replicas[replica]
        self._poller.unregister(old)
        dealer = self.endpoint.replace_peer(self._names[replica], address, keys)
        self._replicas[replica] = dealer
        self._poller.register(dealer, zmq.POLLIN)
        log.info("replica reconnected", replica=replica, address=address)

    def _take_events(self) -> None:
        for _ in range(MAX_BATCHES_PER_TURN):
            try:
                frames = self.events.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                continue
            try:
                topic = frames[0].decode()
                batch = self._decoder.decode(frames[1])
            except (UnicodeDecodeError, msgspec.DecodeError, msgspec.ValidationError):
                continue
            self.num_batches += 1
            self.dispatch(self.controller.observe(topic, batch))  # a borrowing request its loans released

    def _take_updates(self, replica: int, dealer: zmq.Socket) -> None:
        """The replica's scheduler answers on the DEALER the controller sends it requests through."""
        for _ in range(MAX_BATCHES_PER_TURN):
            try:
                payload = dealer.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self.endpoint.codec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                self.endpoint.drop("undecodable frame", sender=self._names[replica].encode(), error=str(error))
                continue
            if not isinstance(message, RequestUpdates):
                self.endpoint.drop("message type not taken here", sender=self._names[replica].encode(),
                                   type=type(message).__name__)
                continue
            self.busy_since = time.monotonic()
            try:
                self.dispatch(self.controller.handle(FromReplica(replica, message)))
            finally:
                self.busy_since = None

    def close(self) -> None:
        self.events.close()
        super().close()
