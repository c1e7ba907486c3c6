"""The supervisor's rounds (monitor thread): read the children's pings, judge them, and restart
what failed (``ProcessGroup`` mixes this in; ``supervisor.py`` holds the rest of the group).

A failed child is killed (SIGKILL) and started again from its spec, in start order. The worker
ranks of a tensor-parallel group are one unit: when one fails, the others are taken down with it
(they would wait in its collectives), and all start again together at a new rendezvous, within
one restart of the budget; while they restart, ``state()`` names the rank that failed. A
KV-parallel rank whose group can rejoin (KVP without TP or PP, on the CPU: the workers report
``kv_rejoin``) restarts alone instead, at a new rendezvous: the scheduler is told the rank and the
rendezvous before it is READY (``RecoverPipeline`` with ``kv_rank``), since it joins its peers
there only once they get the rejoin plan.
"""

from __future__ import annotations

import selectors
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog

from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import ActorFailed, ActorRestarted
from vllm_actors.protocol.names import KV_CACHE_MANAGER, SCHEDULER, WORKER, replica_actor
from vllm_actors.runtime.children import ActorStartError, Child, Stopping, status_line
from vllm_actors.runtime.monitor import SupervisorLink
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.supervision import Liveness, RestartBudget, exit_detail

if TYPE_CHECKING:
    from vllm_actors.runtime.run_dir import GroupAddresses

log = structlog.get_logger("vllm_actors.runtime.supervisor")

POLL_INTERVAL = 0.1  # the monitor's period: how soon an exit is noticed
RESTARTING = "restarting"


class Recovery:
    """The monitor thread's half of ``ProcessGroup``."""

    if TYPE_CHECKING:  # provided by ProcessGroup
        config: EngineConfig
        worker_info: dict[str, Any]
        addresses: GroupAddresses
        children: list[Child]
        budget: RestartBudget
        liveness: Liveness
        _lock: threading.Lock
        _stop: threading.Event
        _states: dict[str, str]
        _restarts: dict[str, int]
        _down_with: dict[str, str]
        _restart_listeners: list[Callable[[str], None]]

        def _spawn(self, spec: ActorSpec) -> Child: ...

        def _await_ready(self, child: Child, siblings: list[Child] | None = None) -> dict[str, Any]: ...

        def _tp_rendezvous(self) -> str: ...

        def _borrowing_rendezvous(self) -> str: ...

        def _fail(self, reason: str, culprit: Child | None, link: SupervisorLink,
                  events: list[Any] | None = None) -> None: ...

        def _notify(self, listeners: list[Callable[[str], None]], argument: str) -> None: ...

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
        """Kill what is left of the failed children, restart each (in start order), tell the group.
        The worker ranks of a tensor-parallel group are one unit: one failed takes all down, and
        they start again together."""
        noticed = time.monotonic()
        alone = self._alone(failures)
        failures = failures if alone is not None else self._with_unit(failures)
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
        for old in list(self.children):
            if old.actor_id not in failed_ids or any(new.actor_id == old.actor_id for new in restarted):
                continue
            how, detail = next((h, d) for c, h, d in failures if c is old)
            what = f"{old.actor_id} {how} ({detail})"
            if not self.budget.try_spend():
                self._fail(f"restart budget spent ({self.budget.describe()}); last failure: {what}", old, link,
                           events)
                return
            unit = self._ranks_of(old) if old.role == WORKER and old is not alone else [old]
            news = self._restart(unit, what, link, events, rejoin=old is alone)
            if news is None:
                return
            seconds = time.monotonic() - noticed
            for new in news:
                self.liveness.started(new.actor_id)
                with self._lock:
                    attempt = self._restarts[new.actor_id] = self._restarts.get(new.actor_id, 0) + 1
                    self._down_with.pop(new.actor_id, None)
                log.warning("actor restarted", actor=new.actor_id, pid=new.process.pid, attempt=attempt,
                            seconds=round(seconds, 3))
                events.append(ActorRestarted(actor=new.actor_id, pid=new.process.pid, attempt=attempt,
                                             seconds=seconds))
                restarted.append(new)
        if path_down:
            link.unconfirm()
        link.publish(events)
        self._recover_pipelines([child for child in restarted if alone is None or child.actor_id != alone.actor_id],
                                link)
        for child in restarted:
            self._notify(self._restart_listeners, child.actor_id)

    def _recover_pipelines(self, restarted: list[Child], link: SupervisorLink) -> None:
        """Per replica: a restarted KV-cache manager or worker (rank 0 answers for the ranks) costs
        its scheduler the pipeline (``RecoverPipeline`` to it); a restarted scheduler resets its
        pipeline with its first plan, and in a replica set the controller sends it that replica's
        requests again."""
        by_replica: dict[int | None, list[Child]] = {}
        for child in restarted:
            by_replica.setdefault(child.spec.replica, []).append(child)
        for replica, children in by_replica.items():
            roles = {child.role for child in children}
            if SCHEDULER in roles:
                if replica is not None:
                    link.recover_pipeline(replica_actor(SCHEDULER, replica), "restarted", self.addresses.scheduler)
                continue
            address = None if replica is None else self.addresses.replicas[replica].scheduler
            for child in children:
                if child.role == KV_CACHE_MANAGER or (child.role == WORKER and child.spec.rank == 0):
                    link.recover_pipeline(child.actor_id, f"{child.actor_id} restarted", address)

    def _ranks_of(self, worker: Child) -> list[Child]:
        """The worker ranks of ``worker``'s replica (its tensor-parallel group); under ``kv_borrowing``
        every replica's worker (one gloo world for the set: none can rejoin it alone)."""
        if self.config.kv_borrowing:
            return [c for c in self.children if c.role == WORKER]
        return [c for c in self.children if c.role == WORKER and c.spec.replica == worker.spec.replica]

    def _alone(self, failures: list[tuple[Child, str, str]]) -> Child | None:
        """The one failed worker, where it restarts alone (its KV-parallel peers rejoin it, keeping
        their requests' KV); None where the ranks restart as one unit."""
        workers = [child for child, _, _ in failures if child.role == WORKER]
        if not workers or self.config.kv_parallel_size == 1:
            return None
        if len(failures) == 1 and self.worker_info.get("kv_rejoin"):
            return workers[0]
        log.info("the KV-parallel ranks restart as one unit", actor=workers[0].actor_id, failures=len(failures),
                 why="several failed" if len(failures) > 1 else
                 "a rank restarts alone only under KV parallelism without TP or PP, on the CPU")
        return None

    def _with_unit(self, failures: list[tuple[Child, str, str]]) -> list[tuple[Child, str, str]]:
        """The failures plus the ranks of a tensor-parallel group that did not fail themselves
        (``how`` "unit": they go down with the failed one, waiting in its collectives otherwise)."""
        failed_workers = [child for child, _, _ in failures if child.role == WORKER]
        if not failed_workers or (self.config.world_size == 1 and not self.config.kv_borrowing):
            return failures
        culprit = failed_workers[0].actor_id
        failed = {child.actor_id for child, _, _ in failures}
        siblings = [c for worker in failed_workers for c in self._ranks_of(worker) if c.actor_id not in failed]
        siblings = list({c.actor_id: c for c in siblings}.values())
        with self._lock:
            for sibling in siblings:
                self._down_with[sibling.actor_id] = culprit
        group = "the set's workers (KV borrowing)" if self.config.kv_borrowing else \
            "the replica's pipeline stages and tensor-parallel ranks" if self.config.pipeline_parallel_size > 1 else \
            "the replica's tensor-parallel ranks"
        return failures + [(sibling, "unit", f"{culprit} failed: {group} restart together")
                           for sibling in siblings]

    def _restart(self, unit: list[Child], what: str, link: SupervisorLink, events: list[Any],
                 rejoin: bool = False) -> list[Child] | None:
        """Start ``unit`` (one actor, or every worker rank) again from its specs, the ranks at a new
        rendezvous; None when it could not be (the group failed). ``rejoin``: one KV-parallel rank,
        whose peers join it at the new rendezvous (the scheduler learns of it before it is READY)."""
        for old in unit:
            log.warning("restarting actor", actor=old.actor_id, restarts_in_window=self.budget.used())
            self.liveness.forget(old.actor_id)
        indexes = [self.children.index(old) for old in unit]
        specs = [old.spec for old in unit]
        while True:
            tp_init = "" if unit[0].role != WORKER else \
                self._borrowing_rendezvous() if self.config.kv_borrowing else self._tp_rendezvous()
            specs = [msgspec.structs.replace(spec, incarnation=spec.incarnation + 1, tp_init=tp_init or spec.tp_init)
                     for spec in specs]
            news = [self._spawn(spec) for spec in specs]
            for index, new in zip(indexes, news, strict=True):
                self.children[index] = new  # shutdown() now stops the new process
            if rejoin:
                self._tell_rejoin(news[0], what, tp_init, link)
            try:
                for new, old in zip(news, unit, strict=True):
                    info = self._await_ready(new, news)
                    if old.role == WORKER and info.get("num_blocks") != old.spec.engine.num_gpu_blocks_override:
                        raise ActorStartError(f"actor {old.actor_id} came back with {info.get('num_blocks')} KV "
                                              f"blocks, not {old.spec.engine.num_gpu_blocks_override}")
                return news
            except ActorStartError as error:
                # Killed by a signal while starting (another fault, not a start that cannot
                # work): try again, within the budget. Anything else fails the group.
                exited = [new for new in news if new.process.poll() is not None]
                killed = any(new.process.returncode < 0 for new in exited)
                culprit = exited[0] if exited else news[0]
                for new in news:
                    self._kill(new)
                if killed and self.budget.try_spend():
                    log.warning("restarting actor again: it was killed while starting", actor=culprit.actor_id,
                                returncode=culprit.process.returncode, restarts_in_window=self.budget.used())
                    continue
                self._fail(f"{what}; it could not be restarted: {str(error).splitlines()[0]}", culprit, link, events)
                return None

    def _tell_rejoin(self, new: Child, what: str, rendezvous: str, link: SupervisorLink) -> None:
        """``RecoverPipeline`` naming the KV-parallel rank and where it waits for its peers."""
        replica = new.spec.replica
        address = None if replica is None else self.addresses.replicas[replica].scheduler
        kv_rank = new.spec.rank // self.config.tensor_parallel_size
        log.warning("a KV-parallel rank restarts alone: its peers rejoin it", actor=new.actor_id, kv_rank=kv_rank)
        link.recover_pipeline(new.actor_id, what, address, kv_rank=kv_rank, rendezvous=rendezvous)

    def _kill(self, child: Child) -> None:
        """SIGKILL (a stopped process dies of it too) and reap."""
        if child.process.poll() is None:
            try:
                child.process.kill()
            except ProcessLookupError:
                pass
        child.process.wait()
        child.close_pipes()
