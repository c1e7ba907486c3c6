"""The supervisor: starts the actors of one group as OS processes, in order, keeps them running, and stops them.

Order: the event bus, the metrics store, the worker(s), the KV-cache manager, the scheduler. The
workers come before the KV-cache manager and the scheduler (the design sketch lists them last)
because the size of the KV pool is known only once a worker has loaded the model and measured
the memory left; the scheduler comes last because it is the group's entry point.

Each child is a fresh interpreter (``python -m vllm_actors.runtime.actor_main``), so a user's unguarded
``__main__`` is never imported again. Each reports READY on its stdout pipe (only once the metrics
store has seen its events), then a liveness ping every half second (``runtime/process.py``), and
watches its stdin pipe: when the supervisor dies, even by SIGKILL, the pipe closes and the child
exits. One object owns the processes, pipes and the run directory; its cleanup runs on
``shutdown()``, on garbage collection, at interpreter exit, and when start-up fails halfway.

Let it crash: once started, a monitor thread polls every child (exit) and reads its pings; a child
that exited, went silent for ``liveness_timeout`` seconds, or has been busy on one message for more
than ``max_busy_seconds`` is killed (SIGKILL) and started again from the same spec (a worker with
the pool size it had), and the rest of the group is told: ``ACTOR_FAILED`` and ``ACTOR_RESTARTED``
on the bus (actor ``supervisor``), ``RecoverPipeline`` to the scheduler after the KV-cache manager or
a worker restarted, the ``on_restart`` listeners (a restarted scheduler has lost every request:
its clients re-submit). At most ``max_restarts`` restarts in ``restart_window`` seconds (the
policy: ``runtime/supervision.py``); past that, or when a child cannot start again, the group
fails: ``GROUP_FAILED``, the ``on_failure`` listeners, and the group shuts itself down.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from vllm_actors.models.stage_split import check_stages
from vllm_actors.protocol.config import EngineConfig, SchedulerConfig
from vllm_actors.protocol.events import GroupFailed
from vllm_actors.protocol.names import CONTROLLER, KV_CACHE_MANAGER, SCHEDULER, replica_actor, worker_id
from vllm_actors.runtime.children import (
    ActorDiedError,
    ActorStartError,
    Child,
    Stopping,
    cleanup,
)
from vllm_actors.runtime.host_memory import HostKvMemory
from vllm_actors.runtime.monitor import SupervisorLink
from vllm_actors.runtime.ports import PortReservation
from vllm_actors.runtime.recovery import RESTARTING, Recovery
from vllm_actors.runtime.run_dir import (
    GroupAddresses,
    GroupInfo,
    make_addresses,
    make_run_dir,
    write_group_info,
)
from vllm_actors.runtime.security import GroupKeys
from vllm_actors.runtime.spawning import READY, Spawning
from vllm_actors.runtime.startup import replica_environment
from vllm_actors.runtime.supervision import (
    DEFAULT_LIVENESS_TIMEOUT,
    DEFAULT_MAX_BUSY_SECONDS,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_WINDOW,
    Liveness,
    RestartBudget,
)

if TYPE_CHECKING:
    from vllm_actors.runtime.ray_launch import RayLauncher

__all__ = ["ActorDiedError", "ActorStartError", "ProcessGroup", "replica_environment"]

log = structlog.get_logger(__name__)

STOP_GRACE_SECONDS = 5.0

# Actor states, as ``ProcessGroup.state()`` reports them (and STARTING, READY: spawning.py; RESTARTING).
FAILED, STOPPED = "failed", "stopped"


def _monitor(group_ref: weakref.ReferenceType[ProcessGroup], stop: threading.Event) -> None:
    """The monitor thread: holds the group only weakly (a dropped group is still collected)."""
    group = group_ref()
    if group is None:
        return
    link = SupervisorLink(group.addresses, stop, keys=group.keys)
    del group
    try:
        while not stop.is_set():
            group = group_ref()
            if group is None:
                return
            try:
                group._tick(link)
            except Stopping:
                return
            except Exception as error:  # a bug here must not leave the group unsupervised
                log.exception("the supervisor's monitor failed")
                group._fail(f"the supervisor's monitor failed: {type(error).__name__}: {error}", None, link)
                return
            finally:
                del group
    finally:
        link.close()


class ProcessGroup(Spawning, Recovery):
    """The actors of one engine as supervised processes.

    Supervision (after ``start()``): ``max_restarts`` restarts at most in any ``restart_window``
    seconds, for the whole group; a child is hung after ``liveness_timeout`` seconds without a ping
    or ``max_busy_seconds`` on one message. ``state()`` and ``failed`` report it;
    ``on_restart``/``on_failure`` register listeners, called from the monitor thread.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        tcp_host: str | None = None,
        keys: GroupKeys | None = None,
        start_timeout: float = 300.0,
        check_invariants: bool = False,
        metrics_max_events: int = 50_000,
        log_dir: str | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        restart_window: float = DEFAULT_RESTART_WINDOW,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT,
        max_busy_seconds: float = DEFAULT_MAX_BUSY_SECONDS,
    ) -> None:
        if config.distributed_executor_backend == "mp":  # before any process: a clear ValueError
            check_stages(config.model, config.pipeline_parallel_size)
        self.config = config
        self.start_timeout = start_timeout
        self.check_invariants = check_invariants
        self.metrics_max_events = metrics_max_events
        self.budget = RestartBudget(max_restarts, restart_window, time.monotonic)
        self.liveness = Liveness(liveness_timeout, max_busy_seconds, time.monotonic)
        self.run_dir = make_run_dir()
        self.log_dir = Path(log_dir) if log_dir else self.run_dir
        # TCP: the group's ports stay held (runtime/ports.py) until it stops, so that no one
        # takes one before its actor binds it or while the actor restarts.
        self._ports = PortReservation(tcp_host) if tcp_host is not None else None
        self.addresses: GroupAddresses = make_addresses(self.run_dir, config.world_size, tcp_host,
                                                        num_replicas=config.data_parallel_size, ports=self._ports)
        # TCP: CURVE keys made for this group (or handed to it by a launcher: ``keys``), in its run
        # directory (0600) for actors and clients.
        self.keys: GroupKeys | None = None
        if tcp_host is not None:
            self.keys = keys or GroupKeys.generate()
            self.keys.save(self.run_dir)
        elif keys is not None:
            raise ValueError("keys are for TCP endpoints: pass tcp_host too")
        self.children: list[Child] = []
        # distributed_executor_backend "ray": the replicas are Ray's (runtime/ray_launch.py); this
        # group runs the bus, the metrics store and the controller.
        self.ray_launcher: RayLauncher | None = None
        self._remote_max_model_len = 0
        self.worker_info: dict[str, Any] = {}
        self.scheduler_config: SchedulerConfig | None = None
        self.failed: str | None = None  # why the group gave up (None while it serves or restarts)
        self._failure_log = ""  # the end of the log of the actor that failed the group
        self._states: dict[str, str] = {}
        self._restarts: dict[str, int] = {}
        self._tp_starts = 0  # starts of the worker ranks so far: each meets at a new rendezvous
        self._down_with: dict[str, str] = {}  # a rank restarting because another one failed -> that one
        self._restart_listeners: list[Callable[[str], None]] = []
        self._failure_listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._finalizer = weakref.finalize(
            self, cleanup, self.children, self.run_dir, STOP_GRACE_SECONDS, self._stop, self._monitor, self._stopped
        )
        # The host KV tier's memory outlives the workers (a restarted one resumes from it): ours.
        self.host_memory = HostKvMemory() if config.kv_cache_offload_gb else None

    # ------------------------------------------------------------------ start
    # _spawn_child, _spawn_workers, _workers_ready, _spawn_pipeline, _await_ready: spawning.py
    def start(self) -> ProcessGroup:
        try:
            # Everything that waits on nothing starts at once: the bus, the metrics store and every
            # replica's workers (the slowest: torch and the model); a worker reports READY only once
            # the store has seen its events, so it may come up before them.
            bus, metrics = self._spawn_child("bus", "bus"), self._spawn_child("metrics", "metrics")
            if self.config.distributed_executor_backend == "ray":
                self._await_ready(bus)
                self._await_ready(metrics)
                self._start_ray_replicas()
            else:
                size = self.config.data_parallel_size
                replicas = [None] if size == 1 else list(range(size))
                workers = {replica: self._spawn_workers(replica) for replica in replicas}
                self._await_ready(bus)
                self._await_ready(metrics)
                pipelines = [self._spawn_pipeline(replica, self._workers_ready(workers[replica]))
                             for replica in replicas]
                for child in [child for pipeline in pipelines for child in pipeline]:
                    self._await_ready(child)
                if len(replicas) > 1:  # the clients' entry point, once every replica serves
                    self._await_ready(self._spawn_child(CONTROLLER, CONTROLLER))
        except BaseException:
            self.shutdown()
            raise
        write_group_info(self.info)
        if self.ray_launcher is not None:
            self.on_restart(self.ray_launcher.on_restart)
            self.ray_launcher.start(self.addresses, self.keys)
        for child in self.children:
            self.liveness.started(child.actor_id)
        monitor = threading.Thread(target=_monitor, args=(weakref.ref(self), self._stop),
                                   name="supervisor-monitor", daemon=True)
        self._monitor.append(monitor)
        monitor.start()
        log.info("group started", run_dir=str(self.run_dir), actors=[c.actor_id for c in self.children])
        return self

    @property
    def info(self) -> GroupInfo:
        return GroupInfo(
            pid=os.getpid(),
            run_dir=str(self.run_dir),
            model=self.config.model,
            addresses=self.addresses,
            worker=self.worker_info,
            max_model_len=self.scheduler_config.max_model_len if self.scheduler_config else self._remote_max_model_len,
            tokenizer=None if self.config.skip_tokenizer_init else (self.config.tokenizer or self.config.model),
            data_parallel_size=self.config.data_parallel_size,
            disable_events=self.config.disable_events,
        )

    # ------------------------------------------------------------------ supervision (monitor thread)
    # _tick, _recover, _restart: recovery.py
    def _fail(self, reason: str, culprit: Child | None, link: SupervisorLink, events: list[Any] | None = None) -> None:
        """Give up: GROUP_FAILED, a log line, the failure listeners, then shut the group down."""
        with self._lock:
            if self.failed is not None:
                return
            self.failed = reason
            if culprit is not None:
                self._states[culprit.actor_id] = FAILED
        self._failure_log = culprit.log_tail() if culprit is not None else ""
        log.error("group failed: shutting down", reason=reason)
        link.unconfirm()  # the bus or the store may be the culprit: a bounded, short attempt
        link.publish([*(events or []), GroupFailed(reason=reason)], confirm_timeout=2.0, wait_seen=True)
        self._notify(self._failure_listeners, reason)
        self.shutdown()  # from the monitor thread: the cleanup does not join it

    def _notify(self, listeners: list[Callable[[str], None]], argument: str) -> None:
        with self._lock:
            callbacks = list(listeners)
        for callback in callbacks:
            try:
                callback(argument)
            except Exception:
                log.exception("a supervisor listener failed", listener=repr(callback))

    # ------------------------------------------------------------------ listeners and state
    def on_restart(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(actor_id)`` after every restart, once the actor is READY again (from
        the monitor thread: return quickly, never block on the group). A restart of ``SCHEDULER``
        means its requests are gone: its clients re-submit theirs (``AddRequest.resume``)."""
        with self._lock:
            self._restart_listeners.append(callback)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once when the group gives up, before it shuts down (from the
        monitor thread); at once, here, if it already has."""
        with self._lock:
            self._failure_listeners.append(callback)
            reason = self.failed
        if reason is not None:
            callback(reason)

    def state(self) -> dict[str, str]:
        """Per actor: "starting", "ready", "restarting", "failed" (could not be recovered) or "stopped"."""
        with self._lock:
            states = dict(self._states)
            # A rank restarting because another rank failed says which (/health names the one down).
            for actor, culprit in self._down_with.items():
                if states.get(actor) == RESTARTING:
                    states[actor] = f"{RESTARTING} ({culprit} is down)"
        if self.ray_launcher is not None:  # a Ray-placed replica's pipeline: as its host is
            for replica, host in self.ray_launcher.states().items():
                shown = READY if host == READY else f"{host} (replica {replica}'s Ray host)"
                for name in (*(worker_id(rank) for rank in range(self.config.world_size)),
                             KV_CACHE_MANAGER, SCHEDULER):
                    states[replica_actor(name, replica)] = shown
        if self.stopped:
            return {actor: state if state == FAILED else STOPPED for actor, state in states.items()}
        return states

    def restarts(self) -> dict[str, int]:
        """Per actor: how many times it was restarted."""
        with self._lock:
            return dict(self._restarts)

    def alive(self) -> dict[str, bool]:
        return {child.actor_id: child.process.poll() is None for child in self.children}

    def raise_if_dead(self) -> None:
        """Raise ActorDiedError, with the reason and the end of the culprit's log, once the group
        has failed (deaths it recovers from do not raise)."""
        if self.failed is not None:
            raise ActorDiedError(f"the process group failed: {self.failed}\n{self._failure_log}".rstrip())

    def pids(self) -> dict[str, int]:
        """The current process of every actor (a restart changes it)."""
        return {child.actor_id: child.process.pid for child in self.children}

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        """Stop the monitor, then the children (and the Ray-placed replicas); idempotent, callable
        from a listener."""
        if self.ray_launcher is not None:
            self.ray_launcher.close()
        self._finalizer()
        if self.host_memory is not None:
            self.host_memory.close()
        if self._ports is not None:
            self._ports.close()

    @property
    def stopped(self) -> bool:
        """Every child is gone and the run directory removed."""
        return self._stopped.is_set()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        """Wait until the group has stopped (after ``shutdown()``, or after it failed: it shuts
        itself down once the failure listeners returned); False on timeout."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> ProcessGroup:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
