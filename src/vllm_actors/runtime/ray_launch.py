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
- watches each host in Ray's control store (its actor record: state and restart count, every
  ``CHECK_INTERVAL`` seconds): a host not ALIVE, or restarted since it was last seen up, means the
  replica is down: ``state()`` names it, and ``ReplicaState(up=False)`` tells the controller, which
  re-routes its open requests. (A pending call on the host is no death signal: Ray may hold it
  over a restart and run it on the new instance.) A ``watch`` call kept on each host returns when
  its process group gave up while the host lived: the host is then killed so that Ray restarts it;
- takes a restarted host back: Ray restarts the host (``max_restarts``); once it is ALIVE again
  (its constructor, which starts the new process group, has returned) and answers ``info``, the
  attach directory is rewritten with its new endpoints (``RayReplicaSet._attach``), the bus
  subscription moves there, and ``ReplicaState(up=True)`` tells the controller to connect to it
  and route to it again. A host Ray gives up on (DEAD) leaves its replica "lost".
"""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import structlog
import zmq

from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import ActorRestarted, EventBatch
from vllm_actors.protocol.messages import RecoverPipeline, ReplicaState
from vllm_actors.protocol.names import BUS, CONTROLLER, METRICS, RAY_LAUNCHER, SCHEDULER, SUPERVISOR, replica_actor
from vllm_actors.runtime.ray_replicas import RayReplica, RayReplicaSet, _ray
from vllm_actors.runtime.run_dir import GroupAddresses, GroupInfo
from vllm_actors.runtime.security import GroupKeys, connect
from vllm_actors.runtime.zmq_shell import EVENT_HWM

log = structlog.get_logger(__name__)

READY, DOWN, RESTARTING_HOST, LOST = "ready", "down", "restarting", "lost"
POLL_MS = 100
CHECK_INTERVAL = 0.25  # seconds between two looks at the hosts in Ray's control store
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
        self._controller_restarted = threading.Event()
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

    def on_restart(self, actor_id: str) -> None:
        """The supervisor restarted an actor (its ``on_restart`` listener): a new controller knows
        nothing of the hosts that are down, so it is told again."""
        if actor_id == CONTROLLER:
            self._controller_restarted.set()

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
        self.controller.setsockopt(zmq.IDENTITY, RAY_LAUNCHER.encode())
        self.controller.setsockopt(zmq.LINGER, 0)
        connect(self.controller, addresses.scheduler, keys)
        self.publishers: dict[str, zmq.Socket] = {}
        self.subscribers: dict[int, zmq.Socket] = {}
        self.watches: dict[int, Any] = {}  # replica -> its host's pending watch() call
        self.pending: dict[int, Any] = {}  # replica -> the info() call on its restarted host
        self.awaiting: set[int] = set()  # replicas down, waiting for their host to be ALIVE again
        self.restarts = {replica.index: _host_record(self.ray, replica.actor)[1]
                         for replica in launcher.replica_set.replicas}
        self.next_check = 0.0
        for replica in launcher.replica_set.replicas:
            self._follow(replica)

    def run(self) -> None:
        try:
            while not self.launcher._stop.is_set():
                self._forward()
                self._check_hosts()
                self._check_restarts()
                if self.launcher._controller_restarted.is_set():
                    self.launcher._controller_restarted.clear()
                    for index, state in self.launcher.states().items():
                        if state != READY:
                            self._tell(ReplicaState(replica=index, up=False, reason=f"still {state}"))
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
        """Each host as Ray's control store has it: a restart counted since we last saw it up,
        or a state other than ALIVE, means the replica we knew is gone."""
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + CHECK_INTERVAL
        for index, ref in list(self.watches.items()):  # a host whose process group stopped: restart it
            done, _ = self.ray.wait([ref], timeout=0)
            if done:
                del self.watches[index]
                try:
                    reason = self.ray.get(ref)
                except Exception:  # noqa: BLE001 - the host died: the control store says so below
                    continue
                log.warning("replica's process group stopped: restarting its host", replica=index, reason=reason)
                self.ray.kill(self._replica(index).actor, no_restart=False)
        for replica in self.launcher.replica_set.replicas:
            index = replica.index
            state, restarts = _host_record(self.ray, replica.actor)
            if self.launcher.states()[index] == READY and (state != "ALIVE" or restarts > self.restarts[index]):
                self._down(replica, f"its host is {state} (restarts {restarts})")
            if state == "DEAD" and self.launcher.states()[index] != LOST:
                log.error("replica lost: Ray does not restart its host", replica=index)
                self.launcher._set_state(index, LOST)
                self.pending.pop(index, None)
            elif state == "ALIVE" and index in self.awaiting and index not in self.pending:
                self.restarts[index] = restarts
                self.pending[index] = replica.actor.info.remote()  # the new host, its constructor done

    def _down(self, replica: RayReplica, reason: str) -> None:
        index = replica.index
        log.warning("replica down", replica=index, reason=reason)
        self.launcher._set_state(index, DOWN)
        subscriber = self.subscribers.pop(index, None)
        if subscriber is not None:
            subscriber.close()
        self.watches.pop(index, None)
        self.awaiting.add(index)
        self._tell(ReplicaState(replica=index, up=False, reason=reason[:200]))

    def _check_restarts(self) -> None:
        if not self.pending:
            return
        refs = list(self.pending.values())
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        for index, ref in list(self.pending.items()):
            if ref not in done:
                continue
            del self.pending[index]
            replica = self._replica(index)
            try:
                encoded = self.ray.get(ref)
            except Exception as error:  # noqa: BLE001 - it went again: the next check asks again
                log.warning("a restarted host did not answer", replica=index, error=type(error).__name__)
                continue
            self.awaiting.discard(index)
            self.launcher.replica_set._attach(replica, encoded)  # its new endpoints, for every client here
            self._follow(replica)
            self.launcher._set_state(index, READY)
            log.info("replica back", replica=index)
            self._tell(ReplicaState(replica=index, up=True, reason="its host restarted"))


def _host_record(ray: Any, actor: Any) -> tuple[str, int]:
    """The host's state in Ray's control store (ALIVE, RESTARTING, DEAD, ...) and its restarts."""
    from ray._private.state import actors

    record = actors(actor_id=actor._actor_id.hex())
    return str(record.get("State", "DEAD")), int(record.get("NumRestarts", 0))
