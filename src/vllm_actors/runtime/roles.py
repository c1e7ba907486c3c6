"""The engine's roles, one entry each: how its state machine is built, whom it talks to, what it
accepts from whom, what it reports when ready, whether clients connect to it.

The process entry point (``actor_main``) builds and wires an actor from its entry; the in-process
engine (``clients/inprocess.py``) applies the same accept rules, identities and client screening
to the state machines it builds itself. The bus and the metrics store are no state machine's
shell: their process bodies are ``bus.run_bus`` and ``metrics_shell.run_metrics``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.envs import envs
from vllm_actors.protocol.kv_loans import BorrowKv, LendKv, ReturnKv
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    ControlReply,
    EngineControl,
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
    WORKER,
    replica_actor,
    worker_id,
)
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.runtime.loop import AcceptRules
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.security import attached_scheduler
from vllm_actors.runtime.transport import Actor
from vllm_actors.runtime.worker_threads import worker_threads


@dataclass(frozen=True)
class Built:
    """A role's state machine, and what its process reports with its readiness."""

    actor: Actor
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Role:
    name: str
    build: Callable[[ActorSpec], Built]
    # in replica r (None: a group of one replica), the worker rank that answers (the last stage's first)
    accepts: Callable[[int | None, int], AcceptRules]
    peers: Callable[[ActorSpec], dict[str, list[str]]]  # peer name -> its addresses
    inbox: Callable[[ActorSpec], str]  # where it receives
    clients_connect: bool = False  # requests come from clients: screened for request identity
    follows_bus: bool = False  # it reads the bus too (the controller's shell)

    def actor_id(self, replica: int | None, rank: int = 0) -> str:
        """Its id (a DEALER identity, a bus topic): a worker's by rank, within its replica."""
        return replica_actor(worker_id(rank) if self.name == WORKER else self.name, replica)


def _own(name: str, replica: int | None) -> bytes:
    """A peer of this replica, as its DEALER identity reads."""
    return replica_actor(name, replica).encode()


class Checked:
    """Runs an actor's invariant check after every message it handles (tests turn this on)."""

    def __init__(self, actor: Any, check: Callable[[], None]) -> None:
        self.actor = actor
        self.check = check
        self.name = actor.name

    def handle(self, message: Any) -> Outputs:
        outputs = self.actor.handle(message)
        self.check()
        return outputs


# --------------------------------------------------------------------------- worker
def build_worker(spec: ActorSpec) -> Built:
    import torch

    from vllm_actors.models.kv_parallel import join_kv_parallel
    from vllm_actors.models.parallel import join_group
    from vllm_actors.runner.build import build_worker as worker_of
    from vllm_actors.runner.devices import resolve_device
    from vllm_actors.runtime.step_profiler import profiled
    from vllm_actors.runtime.torch_profiler import torch_profiled

    device_type = resolve_device(spec.engine.device).type
    engine = spec.engine
    threads = worker_threads(device_type, engine.world_size * engine.data_parallel_size)
    if threads is not None:  # before the model loads: its load runs on these threads too
        torch.set_num_threads(threads)
    tp = join_group(spec.rank, engine.tensor_parallel_size, spec.tp_init, engine.device,
                    engine.world_size // engine.tensor_parallel_size)
    kvp = join_kv_parallel(spec.rank, engine.tensor_parallel_size, engine.kv_parallel_size)
    stage = None
    if engine.pipeline_parallel_size > 1:
        import torch.distributed as dist

        from vllm_actors.models.config import ModelConfig
        from vllm_actors.models.pipeline import make_stage

        stage = make_stage(spec.rank, engine.tensor_parallel_size, engine.pipeline_parallel_size,
                           ModelConfig.from_path(engine.model).num_hidden_layers, dist.group.WORLD)
    worker, info = worker_of(engine, tp=tp, incarnation=spec.incarnation, stage=stage, kvp=kvp,
                             rendezvous=spec.tp_init)
    if engine.kv_borrowing:  # every replica's worker meets the others' in one gloo group
        from vllm_actors.runner.kv_borrowing import join_borrowing

        worker.borrowing = join_borrowing(worker.runner, spec.replica or 0, engine.data_parallel_size, spec.run_dir,
                                          spec.tp_init)
    # VLLM_ACTORS_PROFILE_STEPS and VLLM_TORCH_PROFILER_DIR wrap it
    return Built(torch_profiled(profiled(worker, envs, spec.actor_id), envs, spec.actor_id), info)


def worker_accepts(replica: int | None, answering: int = 0) -> AcceptRules:
    return {StepPlan: frozenset({_own(KV_CACHE_MANAGER, replica)}),
            EngineControl: frozenset({_own(KV_CACHE_MANAGER, replica)})}


# --------------------------------------------------------------------------- KV-cache manager
def build_kv_cache_manager(spec: ActorSpec) -> Built:
    from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager

    manager = KVCacheManager(spec.num_blocks, spec.engine.block_size, spec.num_host_blocks,
                             spec.engine.kv_parallel_size)
    if spec.check_invariants:
        return Built(Checked(manager, manager.check_invariants))
    return Built(manager)


def kv_cache_manager_accepts(replica: int | None, answering: int = 0) -> AcceptRules:
    return {StepPlan: frozenset({_own(SCHEDULER, replica)}), EngineControl: frozenset({_own(SCHEDULER, replica)})}


# --------------------------------------------------------------------------- scheduler
def build_scheduler(spec: ActorSpec) -> Built:
    from vllm_actors.actors.scheduler.scheduler import Scheduler

    if spec.scheduler is None:
        raise ValueError("the scheduler needs its SchedulerConfig")
    # A restarted scheduler numbers its steps above its predecessors' (see Scheduler).
    scheduler = Scheduler(spec.scheduler, first_step_id=spec.incarnation << 40)
    if spec.check_invariants:
        def check() -> None:
            scheduler.ledger.check_invariants({request.request_id for request in scheduler.running}
                                              | scheduler.loans.ledger_keys())

        return Built(Checked(scheduler, check))
    return Built(scheduler)


def scheduler_accepts(replica: int | None, answering: int = 0) -> AcceptRules:
    # Clients may submit and abort; only rank 0 of the workers (of the last pipeline stage:
    # ``answering``) returns sampled tokens; only the
    # supervisor asks for a pipeline reset (after it restarted the KV-cache manager or a worker).
    # Clients send engine commands; rank 0 of the workers answers those passed on to the workers.
    return {
        AddRequest: None,
        AbortRequests: None,
        EngineControl: None,
        StepResult: frozenset({_own(worker_id(answering), replica)}),
        ControlReply: frozenset({_own(worker_id(answering), replica)}),
        RecoverPipeline: frozenset({SUPERVISOR.encode()}),
        # A replica set's controller asks a lender for blocks for another replica's request.
        LendKv: frozenset({CONTROLLER.encode()}),
        ReturnKv: frozenset({CONTROLLER.encode()}),
        BorrowKv: frozenset({CONTROLLER.encode()}),
    }


# --------------------------------------------------------------------------- controller
def _replica_schedulers(spec: ActorSpec) -> list[str]:
    """The replicas' scheduler endpoints; Ray-placed replicas' from their attach directories."""
    return [attached_scheduler(path)[0] for path in spec.remote_replicas] \
        or [replica.scheduler for replica in spec.addresses.replicas]


def build_controller(spec: ActorSpec) -> Built:
    from vllm_actors.actors.controller.controller import Controller
    from vllm_actors.actors.controller.routing import Router

    engine = spec.engine
    router = Router(engine.routing_policy, len(_replica_schedulers(spec)), block_size=engine.block_size,
                    capacity=engine.max_num_seqs)
    loans = None
    if engine.kv_borrowing and spec.scheduler is not None:  # the spawner passes replica 0's limits and pool
        from vllm_actors.actors.controller.kv_loans import LoanPlanner

        loans = LoanPlanner(len(router.replicas),
                            engine.block_size, spec.scheduler.max_model_len, num_blocks=spec.num_blocks)
    return Built(Controller(router, loans))


def controller_accepts(replica: int | None, answering: int = 0) -> AcceptRules:
    # Clients submit and abort; only the supervisor reports a replica's scheduler restarted, or
    # a Ray-placed replica's host down or up again. The replicas' updates come back on the
    # controller's own DEALERs (controller_shell.py).
    return {
        AddRequest: None,
        AbortRequests: None,
        RecoverPipeline: frozenset({SUPERVISOR.encode(), RAY_LAUNCHER.encode()}),
        ReplicaState: frozenset({RAY_LAUNCHER.encode()}),
    }


# --------------------------------------------------------------------------- the table
ROLES: dict[str, Role] = {
    role.name: role
    for role in (
        Role(WORKER, build_worker, worker_accepts,
             peers=lambda spec: {SCHEDULER: [spec.addresses.scheduler]},
             inbox=lambda spec: spec.addresses.workers[spec.rank] if spec.addresses.workers else ""),
        Role(KV_CACHE_MANAGER, build_kv_cache_manager, kv_cache_manager_accepts,
             peers=lambda spec: {WORKER: list(spec.addresses.workers)},
             inbox=lambda spec: spec.addresses.kv_cache_manager),
        Role(SCHEDULER, build_scheduler, scheduler_accepts,
             peers=lambda spec: {KV_CACHE_MANAGER: [spec.addresses.kv_cache_manager]},
             inbox=lambda spec: spec.addresses.scheduler, clients_connect=True),
        Role(CONTROLLER, build_controller, controller_accepts,
             peers=lambda spec: {replica_actor(SCHEDULER, index): [entry]
                                 for index, entry in enumerate(_replica_schedulers(spec))},
             inbox=lambda spec: spec.addresses.scheduler,  # the clients' entry point
             clients_connect=True, follows_bus=True),
    )
}


def role_of(name: str) -> Role:
    try:
        return ROLES[name]
    except KeyError:
        raise ValueError(f"unknown role {name!r}") from None
