"""The launching side of a replica set whose replicas Ray placed (``distributed_executor_backend
"ray"``): the supervisor of the launching host runs the bus, the metrics store and the controller
as for local replicas; this module places the replicas (``RayReplicaSet``: one process group per
replica, on TCP endpoints with keys of its own) and keeps the controller told about them.

One thread (``RayLauncher.start``) does three things, with nothing but its own sockets:

- forwards each replica's events: it subscribes to the replica's bus (with that replica's keys)
  and republishes the batches of its pipeline actors (scheduler, KV-cache manager, workers) on the
  launching bus under their names in the set (``scheduler@r``), each on that actor's own bus
  endpoint, so the set's metrics store, taps and the controller's cache mirror see them as they
  see a local replica's. The replica's own bus, metrics store and supervisor are not forwarded;
  a remote scheduler's restart (its supervisor's ``ACTOR_RESTARTED``) becomes ``RecoverPipeline``
  to the controller, as a local one's does;
- watches each host: a ``watch`` call on the host returns or fails when the host's process group
  stops or its process (or node) dies; the replica is then reported down (``state()`` names it,
  ``ReplicaState(up=False)`` to the controller, which re-routes its open requests);
- takes a restarted host back: Ray restarts the host (``max_restarts``); once it answers
  ``info`` the attach directory is rewritten with its new endpoints (``RayReplicaSet._attach``),
  the bus subscription moves there, and ``ReplicaState(up=True)`` tells the controller to connect
  to it and route to it again. A host whose process group failed while the host lived is killed
  so that Ray restarts it.
"""

from __future__ import annotations

import threading
from typing import Any

import msgspec
import structlog
import zmq

from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import ActorRestarted, EventBatch
from vllm_actors.protocol.messages import RecoverPipeline, ReplicaState
from vllm_actors.protocol.names import BUS, METRICS, SCHEDULER, SUPERVISOR, replica_actor
from vllm_actors.runtime.ray_replicas import RayReplica, RayReplicaSet, _ray
from vllm_actors.runtime.run_dir import GroupAddresses, GroupInfo
from vllm_actors.runtime.security import GroupKeys, connect
from vllm_actors.runtime.zmq_shell import EVENT_HWM

log = structlog.get_logger(__name__)

READY, DOWN, RESTARTING_HOST, LOST = "ready", "down", "restarting", "lost"
POLL_MS = 100
MAX_INFO_ATTEMPTS = 3  # failed ``info`` calls on a restarting host before it counts as lost
NOT_FORWARDED = (BUS, METRICS, SUPERVISOR)


def replica_config(config: EngineConfig) -> EngineConfig:
    """What each Ray-placed replica runs: one replica of ``config`` under its own supervisor."""
    return msgspec.structs.replace(config, data_parallel_size=1, distributed_executor_backend="mp")


class RayLauncher:
    """The replicas of ``config`` placed by Ray, and the thread that keeps the controller told."""

    def __init__(self, config: EngineConfig, *, start_timeout: float = 300.0) -> None:
        self.replica_set = RayReplicaSet(replica_config(config), config.data_parallel_size,
                                         start_timeout=start_timeout)
        self.start_timeout = start_timeout
        self._states = {replica.index: READY for replica in self.replica_set.replicas}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def attach_dirs(self) -> list[str]:
        return [str(replica.attach_dir) for replica in self.replica_set.replicas]

    def first_info(self) -> GroupInfo:
        info = self.replica_set.replicas[0].info
        assert info is not None
        return info

    def states(self) -> dict[int, str]:
        """Per replica: "ready", "down" (its host is gone), "restarting" (Ray started it again,
        it is not serving yet) or "lost" (it cannot come back)."""
        with self._lock:
            return dict(self._states)

    def start(self, addresses: GroupAddresses, keys: GroupKeys | None) -> None:
        """Start the thread: ``addresses`` and ``keys`` are the launching group's (its bus, its controller)."""
        self._thread = threading.Thread(target=self._run, args=(addresses, keys), name="ray-replicas", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)
        self.replica_set.close()

    # ------------------------------------------------------------------ the thread
    def _run(self, addresses: GroupAddresses, keys: GroupKeys | None) -> None:
        try:
            _Loop(self, addresses, keys).run()
        except Exception:  # the launcher's thread must not die silently: the set would stop healing
            log.exception("the Ray replica launcher failed")

    def _set_state(self, replica: int, state: str) -> None:
        with self._lock:
            self._states[replica] = state


class _Loop:
    def __init__(self, launcher: RayLauncher, addresses: GroupAddresses, keys: GroupKeys | None) -> None:
        self.launcher = launcher
        self.ray = _ray()
        self.addresses = addresses
        self.keys = keys
        self.context = zmq.Context()
        self.codec = MessageCodec()
        self.decoder = msgspec.msgpack.Decoder(EventBatch)
        self.encoder = msgspec.msgpack.Encoder()
        self.controller = self.context.socket(zmq.DEALER)
        self.controller.setsockopt(zmq.IDENTITY, SUPERVISOR.encode())
        self.controller.setsockopt(zmq.LINGER, 0)
        connect(self.controller, addresses.scheduler, keys)
        self.publishers: dict[str, zmq.Socket] = {}
        self.subscribers: dict[int, zmq.Socket] = {}
        self.watches: dict[int, Any] = {}  # replica -> its host's pending watch() call
        self.pending: dict[int, tuple[Any, int]] = {}  # replica -> (info() call on the restarting host, attempt)
        for replica in launcher.replica_set.replicas:
            self._follow(replica)

    def run(self) -> None:
        try:
            while not self.launcher._stop.is_set():
                self._forward()
                self._check_hosts()
                self._check_restarts()
        finally:
            for socket in [self.controller, *self.publishers.values(), *self.subscribers.values()]:
                socket.close()
            self.context.term()

    def _replica(self, index: int) -> RayReplica:
        return self.launcher.replica_set.replicas[index]

    def _follow(self, replica: RayReplica) -> None:
        """Subscribe to the replica's bus (its current endpoints) and watch its host."""
        assert replica.info is not None
        subscriber = self.context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.RCVHWM, EVENT_HWM)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        connect(subscriber, replica.info.addresses.bus_out, replica.keys)
        self.subscribers[replica.index] = subscriber
        self.watches[replica.index] = replica.actor.watch.remote()

    # ------------------------------------------------------------------ events
    def _forward(self) -> None:
        poller = zmq.Poller()
        for subscriber in self.subscribers.values():
            poller.register(subscriber, zmq.POLLIN)
        if not self.subscribers:
            self.launcher._stop.wait(POLL_MS / 1000)
            return
        ready = dict(poller.poll(POLL_MS))
        for index, subscriber in list(self.subscribers.items()):
            if subscriber not in ready:
                continue
            for _ in range(1_000):
                try:
                    frames = subscriber.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._republish(index, frames)

    def _republish(self, replica: int, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        try:
            batch = self.decoder.decode(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        if batch.actor != frames[0].decode(errors="replace"):
            return
        if batch.actor == SUPERVISOR:
            if any(isinstance(event, ActorRestarted) and event.actor == SCHEDULER for event in batch.events):
                self._tell(RecoverPipeline(actor=replica_actor(SCHEDULER, replica), reason="restarted"))
            return
        if batch.actor in NOT_FORWARDED:
            return
        name = replica_actor(batch.actor, replica)
        publisher = self.publishers.get(name)
        if publisher is None:
            if name not in self.addresses.bus_in_actors:
                return  # not an actor of a replica's pipeline
            publisher = self.publishers[name] = self.context.socket(zmq.PUB)
            publisher.setsockopt(zmq.SNDHWM, EVENT_HWM)
            publisher.setsockopt(zmq.LINGER, 0)
            connect(publisher, self.addresses.bus_in_actors[name], self.keys)
        renamed = msgspec.structs.replace(batch, actor=name)
        publisher.send_multipart([name.encode(), self.encoder.encode(renamed)])

    def _tell(self, message: ReplicaState | RecoverPipeline) -> None:
        self.controller.send(self.codec.encode(message))

    # ------------------------------------------------------------------ hosts
    def _check_hosts(self) -> None:
        if not self.watches:
            return
        refs = list(self.watches.values())
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for index, ref in list(self.watches.items()):
            if ref not in done:
                continue
            del self.watches[index]
            replica = self._replica(index)
            try:
                reason = f"its process group stopped: {self.ray.get(ref)}"
                self.ray.kill(replica.actor, no_restart=False)  # the host lives on without a group: restart it
            except Exception as error:  # noqa: BLE001 - the host's process or its node died
                reason = f"its host died: {type(error).__name__}"
            log.warning("replica down", replica=index, reason=reason)
            self.launcher._set_state(index, DOWN)
            subscriber = self.subscribers.pop(index, None)
            if subscriber is not None:
                subscriber.close()
            self._tell(ReplicaState(replica=index, up=False, reason=reason[:200]))
            self.pending[index] = (replica.actor.info.remote(), 1)

    def _check_restarts(self) -> None:
        if not self.pending:
            return
        refs = [ref for ref, _ in self.pending.values()]
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for index, (ref, attempt) in list(self.pending.items()):
            if ref not in done:
                continue
            del self.pending[index]
            replica = self._replica(index)
            try:
                encoded = self.ray.get(ref)
            except Exception as error:  # noqa: BLE001 - still dying, or out of restarts
                if attempt >= MAX_INFO_ATTEMPTS:
                    log.error("replica lost: its host does not come back", replica=index, error=repr(error))
                    self.launcher._set_state(index, LOST)
                    continue
                self.launcher._set_state(index, RESTARTING_HOST)
                self.pending[index] = (replica.actor.info.remote(), attempt + 1)
                continue
            self.launcher.replica_set._attach(replica, encoded)  # its new endpoints, for every client here
            self._follow(replica)
            self.launcher._set_state(index, READY)
            log.info("replica back", replica=index)
            self._tell(ReplicaState(replica=index, up=True, reason="its host restarted"))
