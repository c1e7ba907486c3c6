"""One actor process: ``python -m vllm_actors.runtime.actor_main SPEC_JSON``.

Started by the supervisor in a fresh interpreter. The contract with the supervisor:
- stdin is a pipe from the supervisor; EOF on it means the supervisor is gone (even by SIGKILL),
  and the actor exits;
- exactly one JSON line on stdout: ``{"status": "ready", "info": {...}}`` once the actor serves,
  or ``{"status": "error", "error": "..."}``; logs go to stderr;
- SIGTERM or SIGINT: publish DRAINING/STOPPED and exit 0.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import structlog
import zmq

from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import EngineConfig, SchedulerConfig
from vllm_actors.runtime.log_setup import configure_logging
from vllm_actors.runtime.metrics_shell import run_metrics
from vllm_actors.protocol.events import ActorDraining, ActorReady, ActorStarting, ActorStopped, Heartbeat
from vllm_actors.protocol.messages import AbortRequests, AddRequest, StepPlan, StepResult
from vllm_actors.runtime.run_dir import GroupAddresses
from vllm_actors.protocol.names import worker_id
from vllm_actors.runtime.zmq_shell import EVENT_HWM, ActorShell, EventPublisher, wait_until_seen

log = structlog.get_logger(__name__)

HARD_EXIT_SECONDS = 3.0
READY_TIMEOUT = 60.0


class ActorSpec(msgspec.Struct, kw_only=True):
    role: str  # "bus", "metrics", "worker", "kv_cache_manager", "scheduler"
    actor_id: str
    addresses: GroupAddresses
    engine: EngineConfig
    scheduler: SchedulerConfig | None = None
    num_blocks: int = 0
    rank: int = 0
    check_invariants: bool = False
    metrics_max_events: int = 100_000


def report(status: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"status": status, **fields}) + "\n")
    sys.stdout.flush()


def watch_parent(stop: threading.Event) -> None:
    """Exit when the supervisor's end of our stdin closes (it died or let us go)."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(1024):
                pass
        except (OSError, ValueError):
            pass
        stop.set()
        timer = threading.Timer(HARD_EXIT_SECONDS, os._exit, args=(3,))
        timer.daemon = True
        timer.start()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def install_signal_handlers(stop: threading.Event) -> None:
    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


# --------------------------------------------------------------------------- infrastructure roles
def run_bus(spec: ActorSpec, context: zmq.Context, stop: threading.Event) -> None:
    """The event bus: an XSUB/XPUB proxy. Actors publish into XSUB; subscribers read XPUB."""
    frontend = context.socket(zmq.XSUB)
    backend = context.socket(zmq.XPUB)
    for socket in (frontend, backend):
        socket.setsockopt(zmq.SNDHWM, EVENT_HWM)
        socket.setsockopt(zmq.RCVHWM, EVENT_HWM)
        socket.setsockopt(zmq.LINGER, 0)
    frontend.bind(spec.addresses.bus_in)
    backend.bind(spec.addresses.bus_out)
    control = context.socket(zmq.PAIR)
    control.bind("inproc://bus-control")
    terminator = context.socket(zmq.PAIR)
    terminator.connect("inproc://bus-control")

    def terminate_on_stop() -> None:
        stop.wait()
        terminator.send(b"TERMINATE")

    threading.Thread(target=terminate_on_stop, daemon=True).start()
    report("ready", info={})
    zmq.proxy_steerable(frontend, backend, None, control)
    for socket in (frontend, backend, control, terminator):
        socket.close()


# --------------------------------------------------------------------------- engine roles
def build_actor(spec: ActorSpec) -> tuple[Any, dict[str, list[str]], dict[type, frozenset[bytes] | None], dict[str, Any]]:
    """The state machine of a role, its peers, what it accepts from whom, and what it reports."""
    addresses = spec.addresses
    if spec.role == "worker":
        import torch

        from vllm_actors.actors.worker.worker import Worker
        from vllm_actors.actors.worker.model_runner import ModelRunner
        from vllm_actors.actors.worker.sampler import Sampler

        threads = os.environ.get("VLLM_ACTORS_WORKER_THREADS")
        if threads:
            torch.set_num_threads(int(threads))
        runner = ModelRunner(spec.engine)
        worker = Worker(runner, Sampler(runner.device, spec.engine.seed), clock=time.perf_counter)
        mc = runner.model_config
        info = {
            "num_blocks": runner.num_blocks,
            "max_position_embeddings": mc.max_position_embeddings,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids),
            "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."),
        }
        return worker, {"scheduler": [addresses.scheduler]}, {StepPlan: frozenset({b"kv_cache_manager"})}, info
    if spec.role == "kv_cache_manager":
        from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager

        manager = KVCacheManager(spec.num_blocks, spec.engine.block_size)
        if spec.check_invariants:
            manager = _Checked(manager, manager.check_invariants)
        return manager, {"worker": list(addresses.workers)}, {StepPlan: frozenset({b"scheduler"})}, {}
    if spec.role == "scheduler":
        from vllm_actors.actors.scheduler.scheduler import Scheduler

        if spec.scheduler is None:
            raise ValueError("the scheduler needs its SchedulerConfig")
        # Clients may submit and abort; only rank 0 of the workers returns sampled tokens.
        accepts = {AddRequest: None, AbortRequests: None, StepResult: frozenset({worker_id(0).encode()})}
        scheduler = Scheduler(spec.scheduler)
        peers = {"kv_cache_manager": [addresses.kv_cache_manager]}
        if spec.check_invariants:
            def check() -> None:
                scheduler.ledger.check_invariants({request.request_id for request in scheduler.running})

            return _Checked(scheduler, check), peers, accepts, {}
        return scheduler, peers, accepts, {}
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


def run_engine_actor(spec: ActorSpec, context: zmq.Context, stop: threading.Event) -> None:
    publisher_for_start = EventPublisher(context, spec.addresses.bus_in, spec.actor_id)
    pid = os.getpid()
    publisher_for_start.publish([ActorStarting(pid=pid, role=spec.role)])
    actor, peers, accepts, info = build_actor(spec)
    inbox = {
        "worker": spec.addresses.workers[spec.rank] if spec.addresses.workers else "",
        "kv_cache_manager": spec.addresses.kv_cache_manager,
        "scheduler": spec.addresses.scheduler,
    }[spec.role]
    shell = ActorShell(context, actor, spec.actor_id, inbox, spec.addresses.bus_in, peers, accepts,
                       MessageCodec.for_actor(spec.role))
    shell.publisher.stamper = publisher_for_start.stamper  # one sequence per actor
    publisher_for_start.close()
    try:
        wait_until_seen(shell.publisher, context, spec.addresses.metrics, spec.actor_id, READY_TIMEOUT,
                        lambda: Heartbeat(pid=pid))
        shell.publisher.publish([ActorReady(pid=pid, role=spec.role)])
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
        if spec.role == "bus":
            run_bus(spec, context, stop)
        elif spec.role == "metrics":
            run_metrics(spec, context, stop)
        else:
            run_engine_actor(spec, context, stop)
    except Exception as error:
        log.error("actor failed", error=str(error), traceback=traceback.format_exc())
        report("error", error=f"{type(error).__name__}: {error}")
        return 1
    finally:
        context.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
