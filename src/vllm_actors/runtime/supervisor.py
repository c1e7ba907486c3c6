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
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import structlog

from vllm_actors.protocol.config import (
    EngineConfig,
    SchedulerConfig,
    resolve_scheduler_config,
)
from vllm_actors.protocol.events import ActorFailed, ActorRestarted, GroupFailed
from vllm_actors.protocol.names import KV_CACHE_MANAGER, SCHEDULER, WORKER, worker_id
from vllm_actors.runtime.children import (
    ActorDiedError,
    ActorStartError,
    Child,
    Stopping,
    cleanup,
    status_line,
)
from vllm_actors.runtime.monitor import SupervisorLink
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.run_dir import (
    GroupAddresses,
    GroupInfo,
    make_addresses,
    make_run_dir,
    write_group_info,
)
from vllm_actors.runtime.security import GroupKeys
from vllm_actors.runtime.supervision import (
    DEFAULT_LIVENESS_TIMEOUT,
    DEFAULT_MAX_BUSY_SECONDS,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_RESTART_WINDOW,
    Liveness,
    RestartBudget,
    exit_detail,
)

log = structlog.get_logger(__name__)

STOP_GRACE_SECONDS = 5.0
POLL_INTERVAL = 0.1  # the monitor's period: how soon an exit is noticed

# Actor states, as ``ProcessGroup.state()`` reports them.
STARTING, READY, RESTARTING, FAILED, STOPPED = "starting", "ready", "restarting", "failed", "stopped"


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


class ProcessGroup:
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
        start_timeout: float = 300.0,
        check_invariants: bool = False,
        metrics_max_events: int = 50_000,
        log_dir: str | None = None,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        restart_window: float = DEFAULT_RESTART_WINDOW,
        liveness_timeout: float = DEFAULT_LIVENESS_TIMEOUT,
        max_busy_seconds: float = DEFAULT_MAX_BUSY_SECONDS,
    ) -> None:
        self.config = config
        self.start_timeout = start_timeout
        self.check_invariants = check_invariants
        self.metrics_max_events = metrics_max_events
        self.budget = RestartBudget(max_restarts, restart_window, time.monotonic)
        self.liveness = Liveness(liveness_timeout, max_busy_seconds, time.monotonic)
        self.run_dir = make_run_dir()
        self.log_dir = Path(log_dir) if log_dir else self.run_dir
        self.addresses: GroupAddresses = make_addresses(self.run_dir, config.tensor_parallel_size, tcp_host)
        # TCP: CURVE keys made for this group, in its run directory (0600) for actors and clients.
        self.keys: GroupKeys | None = None
        if tcp_host is not None:
            self.keys = GroupKeys.generate()
            self.keys.save(self.run_dir)
        self.children: list[Child] = []
        self.worker_info: dict[str, Any] = {}
        self.scheduler_config: SchedulerConfig | None = None
        self.failed: str | None = None  # why the group gave up (None while it serves or restarts)
        self._failure_log = ""  # the end of the log of the actor that failed the group
        self._states: dict[str, str] = {}
        self._restarts: dict[str, int] = {}
        self._restart_listeners: list[Callable[[str], None]] = []
        self._failure_listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor: list[threading.Thread] = []
        self._stopped = threading.Event()
        self._finalizer = weakref.finalize(
            self, cleanup, self.children, self.run_dir, STOP_GRACE_SECONDS, self._stop, self._monitor, self._stopped
        )

    # ------------------------------------------------------------------ start
    def start(self) -> ProcessGroup:
        try:
            self._start_child("bus", "bus")
            self._start_child("metrics", "metrics")
            for rank in range(self.config.tensor_parallel_size):
                self.worker_info = self._start_child("worker", worker_id(rank), rank=rank)
            num_blocks = int(self.worker_info["num_blocks"])
            self.scheduler_config = resolve_scheduler_config(
                self.config, int(self.worker_info["max_position_embeddings"]), num_blocks,
                vocab_size=int(self.worker_info["vocab_size"]),
            )
            self._start_child("kv_cache_manager", "kv_cache_manager", num_blocks=num_blocks)
            self._start_child("scheduler", "scheduler", scheduler=self.scheduler_config, num_blocks=num_blocks)
        except BaseException:
            self.shutdown()
            raise
        write_group_info(self.info)
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
            max_model_len=self.scheduler_config.max_model_len if self.scheduler_config else 0,
            tokenizer=None if self.config.skip_tokenizer_init else (self.config.tokenizer or self.config.model),
        )

    def _start_child(self, role: str, actor_id: str, **spec_fields: Any) -> dict[str, Any]:
        spec = ActorSpec(
            role=role,
            actor_id=actor_id,
            addresses=self.addresses,
            engine=self.config,
            check_invariants=self.check_invariants,
            metrics_max_events=self.metrics_max_events,
            run_dir=str(self.run_dir),
            **spec_fields,
        )
        child = self._spawn(spec)
        self.children.append(child)
        info = self._await_ready(child)
        if role == WORKER:
            # A restarted worker must make the same pool (the KV-cache manager and the scheduler
            # keep theirs): pin it, in a copy of the user's config.
            engine = msgspec.structs.replace(self.config, num_gpu_blocks_override=int(info["num_blocks"]))
            child.spec = msgspec.structs.replace(spec, engine=engine)
        return info

    def _spawn(self, spec: ActorSpec) -> Child:
        log_path = self.log_dir / f"{spec.actor_id}.log"
        with self._lock:
            self._states[spec.actor_id] = STARTING if spec.actor_id not in self._states else RESTARTING
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "vllm_actors.runtime.actor_main", msgspec.json.encode(spec).decode()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops us
                close_fds=True,
            )
        return Child(spec.actor_id, spec.role, process, log_path, spec)

    def _await_ready(self, child: Child) -> dict[str, Any]:
        """Wait for the child's READY line (its info); raise ActorStartError if it fails, exits or
        takes longer than ``start_timeout``, ``Stopping`` if the group shuts down meanwhile."""
        deadline = time.monotonic() + self.start_timeout
        with selectors.DefaultSelector() as selector:
            selector.register(child.reader.fd, selectors.EVENT_READ)
            while True:
                for line in child.reader.lines():
                    status = status_line(child, line)
                    if status is None:
                        continue
                    if status.get("status") == "ready":
                        with self._lock:
                            self._states[child.actor_id] = READY
                        return dict(status.get("info") or {})
                    if status.get("status") == "alive":
                        continue
                    error = status.get("error")
                    raise ActorStartError(f"actor {child.actor_id} failed to start: {error}\n{child.log_tail()}")
                if child.reader.eof:
                    child.process.wait(timeout=5)
                    raise ActorStartError(
                        f"actor {child.actor_id} exited with code {child.process.returncode} before READY\n"
                        f"{child.log_tail()}"
                    )
                if self._stop.is_set() and threading.current_thread() in self._monitor:
                    raise Stopping()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ActorStartError(
                        f"actor {child.actor_id} did not report READY within {self.start_timeout:.0f} s\n"
                        f"{child.log_tail()}"
                    )
                if selector.select(min(remaining, POLL_INTERVAL)):
                    child.reader.fill()

    # ------------------------------------------------------------------ supervision (monitor thread)
    def _tick(self, link: SupervisorLink) -> None:
        """One round: read every ping that arrived (waiting up to POLL_INTERVAL), then judge."""
        children = list(self.children)
        open_pipes = [child for child in children if not child.reader.eof]
        if open_pipes:
            with selectors.DefaultSelector() as selector:
                for child in open_pipes:
                    selector.register(child.reader.fd, selectors.EVENT_READ, child)
                ready = [key.data for key, _ in selector.select(POLL_INTERVAL)]
        else:
            self._stop.wait(POLL_INTERVAL)
            ready = []
        for child in ready:
            child.reader.fill()
            for line in child.reader.lines():
                self._on_line(child, line)
        if self._stop.is_set():
            raise Stopping()
        failures: list[tuple[Child, str, str]] = []
        for child in children:
            returncode = child.process.poll()
            if returncode is not None:
                detail = exit_detail(returncode)
                if child.last_error:
                    detail += f": {child.last_error}"
                failures.append((child, "exited", detail))
                continue
            verdict = self.liveness.verdict(child.actor_id)
            if verdict is not None:
                failures.append((child, "hung", verdict))
        if failures:
            self._recover(failures, link)

    def _on_line(self, child: Child, line: bytes) -> None:
        status = status_line(child, line)
        if status is None:
            return
        if status.get("status") == "alive":
            busy = status.get("busy")
            self.liveness.ping(child.actor_id, float(busy) if isinstance(busy, (int, float)) else 0.0)
        elif status.get("status") == "error":
            child.last_error = str(status.get("error"))

    def _recover(self, failures: list[tuple[Child, str, str]], link: SupervisorLink) -> None:
        """Kill what is left of the failed children, restart each (in start order), tell the group."""
        noticed = time.monotonic()
        failed_ids = {child.actor_id for child, _, _ in failures}
        events: list[Any] = []
        for child, how, detail in failures:
            log.error("actor failed", actor=child.actor_id, how=how, detail=detail, pid=child.process.pid,
                      log=str(child.log_path))
            with self._lock:
                self._states[child.actor_id] = RESTARTING
            events.append(ActorFailed(actor=child.actor_id, how=how, detail=detail))
        # With the bus or the store down, the failures could not be seen: publish them after the restarts.
        path_down = bool(failed_ids & {"bus", "metrics"})
        if not path_down:
            link.publish(events)
            events = []
        for child, _, _ in failures:
            self._kill(child)
        restarted: list[Child] = []
        for index, old in enumerate(list(self.children)):
            if old.actor_id not in failed_ids:
                continue
            how, detail = next((h, d) for c, h, d in failures if c is old)
            what = f"{old.actor_id} {how} ({detail})"
            if not self.budget.try_spend():
                self._fail(f"restart budget spent ({self.budget.describe()}); last failure: {what}", old, link,
                           events)
                return
            log.warning("restarting actor", actor=old.actor_id, restarts_in_window=self.budget.used())
            self.liveness.forget(old.actor_id)
            spec = old.spec
            while True:
                spec = msgspec.structs.replace(spec, incarnation=spec.incarnation + 1)
                new = self._spawn(spec)
                self.children[index] = new  # shutdown() now stops the new process
                try:
                    info = self._await_ready(new)
                    if old.role == WORKER and info.get("num_blocks") != old.spec.engine.num_gpu_blocks_override:
                        raise ActorStartError(f"actor {old.actor_id} came back with {info.get('num_blocks')} KV "
                                              f"blocks, not {old.spec.engine.num_gpu_blocks_override}")
                    break
                except ActorStartError as error:
                    # Killed by a signal while starting (another fault, not a start that cannot
                    # work): try again, within the budget. Anything else fails the group.
                    killed = new.process.poll() is not None and new.process.returncode < 0
                    if killed and self.budget.try_spend():
                        log.warning("restarting actor again: it was killed while starting", actor=old.actor_id,
                                    returncode=new.process.returncode, restarts_in_window=self.budget.used())
                        continue
                    self._fail(f"{what}; it could not be restarted: {str(error).splitlines()[0]}", new, link, events)
                    return
            self.liveness.started(new.actor_id)
            seconds = time.monotonic() - noticed
            with self._lock:
                attempt = self._restarts[new.actor_id] = self._restarts.get(new.actor_id, 0) + 1
            log.warning("actor restarted", actor=new.actor_id, pid=new.process.pid, attempt=attempt,
                        seconds=round(seconds, 3))
            events.append(ActorRestarted(actor=new.actor_id, pid=new.process.pid, attempt=attempt, seconds=seconds))
            restarted.append(new)
        if path_down:
            link.unconfirm()
        link.publish(events)
        roles = {child.role for child in restarted}
        if SCHEDULER not in roles:  # a fresh scheduler resets the pipeline with its first plan
            for child in restarted:
                if child.role in (WORKER, KV_CACHE_MANAGER):
                    link.recover_pipeline(child.actor_id, f"{child.actor_id} restarted")
        for child in restarted:
            self._notify(self._restart_listeners, child.actor_id)

    def _kill(self, child: Child) -> None:
        """SIGKILL (a stopped process dies of it too) and reap."""
        if child.process.poll() is None:
            try:
                child.process.kill()
            except ProcessLookupError:
                pass
        child.process.wait()
        child.close_pipes()

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
        """Stop the monitor, then the children; idempotent, callable from a listener."""
        self._finalizer()

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
