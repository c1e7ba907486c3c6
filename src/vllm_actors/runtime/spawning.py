"""Starting a group's children (``ProcessGroup`` mixes this in; ``supervisor.py`` holds the rest of the
group): each actor's spec and process, a replica's worker ranks at one rendezvous with their pool
pinned, the rest of its pipeline once they are READY, and the replicas Ray places."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from vllm_actors.envs import envs
from vllm_actors.protocol.config import EngineConfig, SchedulerConfig, resolve_scheduler_config
from vllm_actors.protocol.names import CONTROLLER, KV_CACHE_MANAGER, SCHEDULER, WORKER, replica_actor, worker_id
from vllm_actors.runtime.children import ActorStartError, Child
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.recovery import RESTARTING
from vllm_actors.runtime.startup import replica_environment, wait_ready

if TYPE_CHECKING:
    from vllm_actors.runtime.host_memory import HostKvMemory
    from vllm_actors.runtime.ray_launch import RayLauncher
    from vllm_actors.runtime.run_dir import GroupAddresses

# Actor states, as ``ProcessGroup.state()`` reports them (and FAILED, STOPPED: supervisor.py; RESTARTING).
STARTING, READY = "starting", "ready"


class Spawning:
    """The start-up half of ``ProcessGroup``: specs, processes, READY."""

    if TYPE_CHECKING:  # provided by ProcessGroup
        config: EngineConfig
        start_timeout: float
        check_invariants: bool
        metrics_max_events: int
        run_dir: Path
        log_dir: Path
        addresses: GroupAddresses
        children: list[Child]
        ray_launcher: RayLauncher | None
        worker_info: dict[str, Any]
        scheduler_config: SchedulerConfig | None
        host_memory: HostKvMemory | None
        _remote_max_model_len: int
        _states: dict[str, str]
        _tp_starts: int
        _lock: threading.Lock
        _stop: threading.Event
        _monitor: list[threading.Thread]

    def _start_ray_replicas(self) -> None:
        """The replicas placed by Ray, each a process group of its own on its node; then the
        controller, connected to their schedulers over TCP with each one's keys."""
        from vllm_actors.runtime.ray_launch import RayLauncher

        self.ray_launcher = RayLauncher(self.config, start_timeout=self.start_timeout)
        first = self.ray_launcher.first_info()
        self.worker_info, self._remote_max_model_len = dict(first.worker), first.max_model_len
        self._await_ready(self._spawn_child(CONTROLLER, CONTROLLER, remote_replicas=self.ray_launcher.attach_dirs))

    def _spawn_pipeline(self, replica: int | None, info: dict[str, Any]) -> list[Child]:
        """The rest of one replica's pipeline once its workers are READY (``info``: rank 0's
        report): its KV-cache manager and its scheduler, started together (None: the group's only
        replica, under the bare names)."""
        num_blocks = int(info["num_blocks"])
        num_host_blocks = int(info.get("num_host_blocks", 0))
        scheduler_config = resolve_scheduler_config(
            self.config, int(info["derived_max_model_len"]), num_blocks, vocab_size=int(info["vocab_size"]),
            allow_long_max_model_len=envs.VLLM_ACTORS_ALLOW_LONG_MAX_MODEL_LEN, num_host_blocks=num_host_blocks,
            host_write_through_tokens=envs.VLLM_ACTORS_KV_OFFLOAD_WRITE_THROUGH_TOKENS,
            attention_wave_tokens=int(info.get("attention_wave_tokens", 0)),
        )
        if replica in (None, 0):
            self.worker_info, self.scheduler_config = info, scheduler_config
        return [
            self._spawn_child("kv_cache_manager", replica_actor(KV_CACHE_MANAGER, replica), num_blocks=num_blocks,
                              num_host_blocks=num_host_blocks, replica=replica),
            self._spawn_child("scheduler", replica_actor(SCHEDULER, replica), scheduler=scheduler_config,
                              num_blocks=num_blocks, replica=replica),
        ]

    def _spec(self, role: str, actor_id: str, replica: int | None = None, **spec_fields: Any) -> ActorSpec:
        if role == CONTROLLER and self.config.kv_borrowing and self.scheduler_config is not None:
            # borrowed KV: the planner starts from replica 0's limits and pool (events correct the pools)
            spec_fields.setdefault("scheduler", self.scheduler_config)
            spec_fields.setdefault("num_blocks", self.scheduler_config.num_blocks)
        return ActorSpec(
            role=role,
            actor_id=actor_id,
            addresses=self.addresses if replica is None else self.addresses.for_replica(replica),
            replica=replica,
            engine=self.config,
            check_invariants=self.check_invariants,
            metrics_max_events=self.metrics_max_events,
            run_dir=str(self.run_dir),
            **spec_fields,
        )

    def _spawn_child(self, role: str, actor_id: str, replica: int | None = None, **spec_fields: Any) -> Child:
        child = self._spawn(self._spec(role, actor_id, replica, **spec_fields))
        self.children.append(child)
        return child

    def _spawn_workers(self, replica: int | None) -> list[Child]:
        """Start every rank of a replica at once (they meet in one rendezvous before any is READY)."""
        tp_init = self._tp_rendezvous()
        children = [self._spawn(self._spec(WORKER, replica_actor(worker_id(rank), replica), replica, rank=rank,
                                           tp_init=tp_init))
                    for rank in range(self.config.world_size)]
        self.children.extend(children)
        return children

    def _workers_ready(self, children: list[Child]) -> dict[str, Any]:
        """Wait for every rank of a replica; pin the pool each made (the same on every rank) so
        that a restart makes it again. Returns rank 0's report."""
        infos = [self._await_ready(child, children) for child in children]
        pools = {int(info["num_blocks"]) for info in infos}
        if len(pools) != 1:
            raise ActorStartError(f"the tensor-parallel ranks made KV pools of different sizes: {sorted(pools)}")
        # A restarted worker must make the same pool (the KV-cache manager and the scheduler
        # keep theirs): pin it, in a copy of the user's config.
        engine = msgspec.structs.replace(self.config, num_gpu_blocks_override=pools.pop())
        for child in children:
            child.spec = msgspec.structs.replace(child.spec, engine=engine)
        return infos[0]

    def _tp_rendezvous(self) -> str:
        """A fresh rendezvous for one start of the worker ranks: a file store in the run
        directory (never a fixed port); "" without tensor parallelism."""
        if self.config.world_size == 1:
            return ""
        self._tp_starts += 1
        return f"file://{self.run_dir}/tp-{self._tp_starts}.store"

    def _borrowing_rendezvous(self) -> str:
        """A fresh meeting of a borrowing set's workers restarted together (their set-wide gloo world;
        the first start meets at ``runner/kv_borrowing.py``'s own store)."""
        self._tp_starts += 1
        return f"file://{self.run_dir}/kv-borrowing-{self._tp_starts}.store"

    def _spawn(self, spec: ActorSpec) -> Child:
        log_path = self.log_dir / f"{spec.actor_id}.log"
        with self._lock:
            self._states[spec.actor_id] = STARTING if spec.actor_id not in self._states else RESTARTING
        inherited = dict(os.environ)
        env = replica_environment(spec, inherited)
        pass_fds: tuple[int, ...] = ()
        if self.host_memory is not None and spec.role == WORKER:  # the host KV tier's shared memory
            env = self.host_memory.environment(spec.actor_id, inherited if env is None else env)
            pass_fds = (self.host_memory.fd_for(spec.actor_id),)
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "vllm_actors.runtime.actor_main", msgspec.json.encode(spec).decode()],
                env=env,
                pass_fds=pass_fds,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops us
                close_fds=True,
            )
        return Child(spec.actor_id, spec.role, process, log_path, spec)

    def _await_ready(self, child: Child, siblings: list[Child] | None = None) -> dict[str, Any]:
        """Wait for the child's READY line (its info); raise ActorStartError if it fails, exits or
        takes longer than ``start_timeout``, or one of ``siblings`` (ranks starting with it, which
        it waits for) exits first; ``Stopping`` if the group shuts down meanwhile."""
        info = wait_ready(child, siblings, self.start_timeout,
                          lambda: self._stop.is_set() and threading.current_thread() in self._monitor)
        with self._lock:
            self._states[child.actor_id] = READY
        return info
