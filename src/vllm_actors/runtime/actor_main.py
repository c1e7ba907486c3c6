"""One actor process: ``python -m vllm_actors.runtime.actor_main SPEC_JSON``.

Started by the supervisor in a fresh interpreter; ``runtime/process.py`` holds the contract with
it (spec, readiness line, parent watch, signals). Here: build the role's state machine, wrap it in
its shell (``zmq_shell.ActorShell``; the bus and the metrics store have their own shells in
``bus.py`` and ``metrics_shell.py``), serve until stopped. SIGTERM or SIGINT: publish
DRAINING/STOPPED and exit 0; a state machine's bug: publish CRASHED and exit 1.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import zmq

from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import (
    ActorDraining,
    ActorReady,
    ActorStarting,
    ActorStopped,
    Heartbeat,
)
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    RecoverPipeline,
    ReplicaState,
    StepPlan,
    StepResult,
)
from vllm_actors.protocol.names import (
    CONTROLLER,
    KV_CACHE_MANAGER,
    RAY_LAUNCHER,
    SCHEDULER,
    SUPERVISOR,
    replica_actor,
    worker_id,
)
from vllm_actors.runtime.bus import run_bus
from vllm_actors.runtime.busy_poll import busy_poll_seconds
from vllm_actors.runtime.controller_shell import ControllerShell
from vllm_actors.runtime.log_setup import configure_logging
from vllm_actors.runtime.metrics_shell import run_metrics
from vllm_actors.runtime.process import (
    READY_TIMEOUT,
    ActorSpec,
    install_signal_handlers,
    report,
    set_busy_source,
    watch_parent,
)
from vllm_actors.runtime.security import GroupKeys, attached_scheduler, authenticating, keys_for
from vllm_actors.runtime.transport import Actor
from vllm_actors.runtime.worker_threads import worker_threads
from vllm_actors.runtime.zmq_shell import ActorShell, EventPublisher, wait_until_seen

log = structlog.get_logger(__name__)

RESTART_SEEN_TIMEOUT = 3.0  # seconds a restarted actor waits for the metrics store to see it

# --------------------------------------------------------------------------- engine roles
AcceptRules = dict[type, frozenset[bytes] | None]


def build_actor(spec: ActorSpec) -> tuple[Actor, dict[str, list[str]], AcceptRules, dict[str, Any]]:
    """The state machine of a role, its peers, what it accepts from whom, and what it reports."""
    addresses = spec.addresses

    def own(name: str) -> bytes:  # a peer of this replica, as its DEALER identity reads
        return replica_actor(name, spec.replica).encode()

    if spec.role == "worker":
        import torch

        from vllm_actors.actors.worker.deferred import defer_steps, tp_graph_draws
        from vllm_actors.actors.worker.grammar import worker_grammars
        from vllm_actors.actors.worker.model_runner import ModelRunner, resolve_device
        from vllm_actors.actors.worker.sampler import Sampler
        from vllm_actors.actors.worker.worker import Worker
        from vllm_actors.models.parallel import join_group
        from vllm_actors.runtime.step_profiler import profiled

        device_type = resolve_device(spec.engine.device).type
        threads = worker_threads(device_type, spec.engine.tensor_parallel_size * spec.engine.data_parallel_size)
        if threads is not None:  # before the model loads: its load runs on these threads too
            torch.set_num_threads(threads)
        tp = join_group(spec.rank, spec.engine.tensor_parallel_size, spec.tp_init, spec.engine.device)
        runner = ModelRunner(spec.engine, tp)
        mc = runner.model_config
        grammars = worker_grammars(spec.engine.tokenizer or spec.engine.model, mc.vocab_size, mc.eos_token_ids)
        worker = Worker(
            runner, Sampler(runner.device, spec.engine.seed), clock=time.perf_counter, defer=defer_steps(),
            tp_graph_draws=tp_graph_draws(),
            grammars=grammars, await_reset=tp.enabled and spec.incarnation > 0,
        )
        profiled_worker = profiled(worker, os.environ, spec.actor_id)  # VLLM_ACTORS_PROFILE_STEPS
        info = {
            "num_blocks": runner.num_blocks,
            "max_position_embeddings": mc.max_position_embeddings,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids),
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
            "rank": tp.rank,
            "tensor_parallel_size": tp.size,
        }
        from_kv: AcceptRules = {StepPlan: frozenset({own(KV_CACHE_MANAGER)})}
        return profiled_worker, {"scheduler": [addresses.scheduler]}, from_kv, info
    if spec.role == "kv_cache_manager":
        from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager

        manager = KVCacheManager(spec.num_blocks, spec.engine.block_size)
        plans: AcceptRules = {StepPlan: frozenset({own(SCHEDULER)})}
        peers = {"worker": list(addresses.workers)}
        if spec.check_invariants:
            return _Checked(manager, manager.check_invariants), peers, plans, {}
        return manager, peers, plans, {}
    if spec.role == "scheduler":
        from vllm_actors.actors.scheduler.scheduler import Scheduler

        if spec.scheduler is None:
            raise ValueError("the scheduler needs its SchedulerConfig")
        # Clients may submit and abort; only rank 0 of the workers returns sampled tokens; only the
        # supervisor asks for a pipeline reset (after it restarted the KV-cache manager or a worker).
        accepts: AcceptRules = {
            AddRequest: None,
            AbortRequests: None,
            StepResult: frozenset({own(worker_id(0))}),
            RecoverPipeline: frozenset({SUPERVISOR.encode()}),
        }
        # A restarted scheduler numbers its steps above its predecessors' (see Scheduler).
        scheduler = Scheduler(spec.scheduler, first_step_id=spec.incarnation << 40)
        peers = {"kv_cache_manager": [addresses.kv_cache_manager]}
        if spec.check_invariants:
            def check() -> None:
                scheduler.ledger.check_invariants({request.request_id for request in scheduler.running})

            return _Checked(scheduler, check), peers, accepts, {}
        return scheduler, peers, accepts, {}
    if spec.role == CONTROLLER:
        from vllm_actors.actors.controller.controller import Controller
        from vllm_actors.actors.controller.routing import Router

        engine = spec.engine
        # Ray-placed replicas: their schedulers' TCP endpoints, from their attach directories.
        entries = [attached_scheduler(path)[0] for path in spec.remote_replicas] \
            or [replica.scheduler for replica in addresses.replicas]
        router = Router(engine.routing_policy, len(entries), block_size=engine.block_size,
                        capacity=engine.max_num_seqs)
        schedulers = {replica_actor(SCHEDULER, index): [entry] for index, entry in enumerate(entries)}
        # Clients submit and abort; only the supervisor reports a replica's scheduler restarted, or
        # a Ray-placed replica's host down or up again. The replicas' updates come back on the
        # controller's own DEALERs (controller_shell.py).
        controls: AcceptRules = {
            AddRequest: None,
            AbortRequests: None,
            RecoverPipeline: frozenset({SUPERVISOR.encode(), RAY_LAUNCHER.encode()}),
            ReplicaState: frozenset({RAY_LAUNCHER.encode()}),
        }
        return Controller(router), schedulers, controls, {}
    raise ValueError(f"unknown role {spec.role!r}")


class _Checked:
    """Runs an actor's invariant check after every message it handles (tests turn this on)."""

    def __init__(self, actor: Any, check: Callable[[], None]) -> None:
        self.actor = actor
        self.check = check
        self.name = actor.name

    def handle(self, message: Any) -> list[tuple[str, Any]]:
        outputs = self.actor.handle(message)
        self.check()
        return outputs


def run_engine_actor(spec: ActorSpec, context: zmq.Context, stop: threading.Event,
                     keys: GroupKeys | None = None) -> None:
    publisher_for_start = EventPublisher.for_actor(context, spec.addresses, spec.actor_id, keys)
    pid = os.getpid()
    publisher_for_start.publish([ActorStarting(pid=pid, role=spec.role)])
    actor, peers, accepts, info = build_actor(spec)
    inbox = {
        "worker": spec.addresses.workers[spec.rank] if spec.addresses.workers else "",
        "kv_cache_manager": spec.addresses.kv_cache_manager,
        "scheduler": spec.addresses.scheduler,
        CONTROLLER: spec.addresses.scheduler,  # the clients' entry point
    }[spec.role]
    bus_in = spec.addresses.publish_address(spec.actor_id)  # its own endpoint: the bus forwards only its id there
    codec = MessageCodec.for_actor(spec.role)
    shell: ActorShell
    if spec.role == CONTROLLER:
        shell = ControllerShell(context, actor, spec.actor_id, inbox, bus_in, peers, accepts, codec, keys=keys,
                                bus_out=spec.addresses.bus_out, remote_replicas=spec.remote_replicas)
    else:
        shell = ActorShell(context, actor, spec.actor_id, inbox, bus_in, peers, accepts, codec, keys=keys)
    shell.publisher.stamper = publisher_for_start.stamper  # one sequence per actor
    shell.busy_poll_s = busy_poll_seconds(spec.engine.device)
    publisher_for_start.close()
    try:
        # A first start waits until the metrics store sees this actor's events (nothing is lost to
        # the slow-joiner problem). A restart must not depend on the store, which may itself be
        # down or hung: it waits briefly, then serves anyway (the store counts what it missed).
        try:
            seen_timeout = READY_TIMEOUT if spec.incarnation == 0 else RESTART_SEEN_TIMEOUT
            wait_until_seen(shell.publisher, context, spec.addresses.metrics, spec.actor_id, seen_timeout,
                            lambda: Heartbeat(pid=pid), keys)
        except TimeoutError:
            if spec.incarnation == 0:
                raise
            log.warning("the metrics store does not see this restarted actor; serving anyway", actor=spec.actor_id)
        shell.publisher.publish([ActorReady(pid=pid, role=spec.role)])
        set_busy_source(shell.busy_seconds)  # the liveness pings report how long a message takes
        report("ready", info=info)
        shell.run(stop)  # a bug publishes CRASHED and propagates: main() exits non-zero
        shell.publisher.publish([ActorDraining(reason="stop"), ActorStopped(reason="stop")])
    finally:
        shell.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()
    spec = msgspec.json.decode(argv[0].encode(), type=ActorSpec)
    structlog.contextvars.bind_contextvars(actor=spec.actor_id)
    stop = threading.Event()
    watch_parent(stop)
    install_signal_handlers(stop)
    context = zmq.Context()
    try:
        keys = keys_for(spec.addresses, spec.run_dir)  # TCP: the group's CURVE keys, from the run directory
        with authenticating(context, keys):
            if spec.role == "bus":
                run_bus(spec, context, stop, keys)
            elif spec.role == "metrics":
                run_metrics(spec, context, stop, keys)
            else:
                run_engine_actor(spec, context, stop, keys)
    except Exception as error:
        log.error("actor failed", exc_info=error)  # one line; the traceback at DEBUG
        report("error", error=f"{type(error).__name__}: {error}")
        return 1
    finally:
        context.term()
    return 0


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: ``main`` has closed the sockets and the context,
    and tearing down torch and the grammar library took a worker about a second after every stop,
    which held up each shutdown of the group. Logs and pipes are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
