"""Replicas placed by Ray (``--distributed-executor-backend ray``): one process group per replica,
each started on the node Ray gives it.

Ray places; it does not carry the engine's messages. A placement group holds one bundle per
replica (its GPUs: ``tensor_parallel_size`` x ``pipeline_parallel_size`` of them; one CPU on a
machine without GPUs), spread over the nodes where it can be. In each bundle a ``ReplicaHost`` Ray
actor starts the replica's process group (``ProcessGroup``: the same bus, metrics store, scheduler,
KV-cache manager and workers as on one host, under the same supervisor) with TCP endpoints on its
node's address.

Keys: the launcher makes one pair of CURVE key pairs per replica (``GroupKeys.generate``) and hands
them to the host through Ray's call arguments, never a command line; the host writes them into its
run directory (0600, as every TCP group does) for its actors, and the launcher writes them, with the
replica's ``group.json``, into a private local directory per replica, so that any client on the
launching machine attaches to a remote replica exactly as to a local one
(``read_group_info(replica.attach_dir)``). Every TCP socket of every replica refuses a peer without
its keys.

Failures: a replica whose host or node dies shows as down in ``states()`` (Ray's actor state); the
host is a restartable Ray actor (``max_restarts``), so Ray starts it again when a node with room
exists, and ``refresh()`` rewrites the attach directory with the new endpoints. Who re-routes the
requests of a replica that is down is the replica-set controller's business, not this module's
(``ray_launch.py`` tells it, through the host's ``watch()``).
"""

from __future__ import annotations

import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import structlog

from vllm_actors.protocol.config import EngineConfig
from vllm_actors.runtime.run_dir import GroupInfo, make_run_dir, write_group_info
from vllm_actors.runtime.security import KEYS_FILE, GroupKeys

log = structlog.get_logger(__name__)

DEFAULT_MAX_RESTARTS = 3


def _ray() -> Any:
    try:
        import ray
    except ImportError as error:  # pragma: no cover - ray is installed with the project
        raise RuntimeError("--distributed-executor-backend ray needs the ray package (pip install ray)") from error
    return ray


class ReplicaHost:
    """Runs inside a Ray actor: one replica's process group on this node, over TCP with the keys
    it was handed."""

    def __init__(self, config: bytes, keys: bytes, start_timeout: float) -> None:
        from vllm_actors.runtime.supervisor import ProcessGroup

        ray = _ray()
        engine_config = msgspec.json.decode(config, type=EngineConfig)
        group_keys = msgspec.json.decode(keys, type=GroupKeys)
        host = ray.util.get_node_ip_address()
        self.group = ProcessGroup(engine_config, tcp_host=host, keys=group_keys, start_timeout=start_timeout)
        self.group.start()
        self.node_id = ray.get_runtime_context().get_node_id()

    def info(self) -> bytes:
        return msgspec.json.encode(self.group.info)

    def where(self) -> tuple[str, int]:
        """The Ray node id and this host's pid."""
        return self.node_id, os.getpid()

    def state(self) -> dict[str, str]:
        return self.group.state()

    def watch(self) -> str:
        """Returns once this host's process group has stopped (it failed: why); while the host's
        process lives it never returns otherwise, and when the process or its node dies the call
        fails. The launcher keeps one such call pending per host (``ray_launch.py``)."""
        self.group.wait_stopped()
        return self.group.failed or "stopped"

    def shutdown(self) -> None:
        self.group.shutdown()


@dataclass
class RayReplica:
    """The launcher's handle on one replica."""

    index: int
    actor: Any  # the ReplicaHost Ray actor
    keys: GroupKeys
    attach_dir: Path  # private local directory: group.json and curve.keys, for clients here
    info: GroupInfo | None = None


class RayReplicaSet:
    """``num_replicas`` process groups placed by Ray; closed with ``close()`` or at exit."""

    def __init__(self, config: EngineConfig, num_replicas: int, *, address: str | None = None,
                 max_restarts: int = DEFAULT_MAX_RESTARTS, start_timeout: float = 300.0,
                 strategy: str = "SPREAD") -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        ray = _ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._initialised_ray = False
        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False)
            self._initialised_ray = True
        gpus = config.world_size if config.device != "cpu" and _cluster_gpus(ray) else 0
        bundle = {"GPU": float(gpus), "CPU": 1.0} if gpus else {"CPU": 1.0}
        self.replicas: list[RayReplica] = []
        self._group = placement_group([dict(bundle) for _ in range(num_replicas)], strategy=strategy)
        self._finalizer = weakref.finalize(self, _close, ray, remove_placement_group, self._group, self.replicas,
                                           self._initialised_ray)
        try:
            ray.get(self._group.ready(), timeout=start_timeout)
            host_class = ray.remote(ReplicaHost)
            encoded = msgspec.json.encode(config)
            for index in range(num_replicas):
                keys = GroupKeys.generate()  # per replica, per launch
                actor = host_class.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=self._group, placement_group_bundle_index=index),
                    num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0.0), max_restarts=max_restarts,
                    max_concurrency=4,  # a pending watch() must not hold up info() or state()
                ).remote(encoded, msgspec.json.encode(keys), start_timeout)
                self.replicas.append(RayReplica(index=index, actor=actor, keys=keys, attach_dir=make_run_dir()))
            for replica in self.replicas:
                self._attach(replica, ray.get(replica.actor.info.remote(), timeout=start_timeout))
        except BaseException:
            self.close()
            raise
        log.info("ray replicas started", replicas=num_replicas, nodes=len({self.node_of(r) for r in self.replicas}))

    def _attach(self, replica: RayReplica, encoded_info: bytes) -> None:
        """Write the replica's group.json (its TCP endpoints) and keys where clients here look."""
        info = msgspec.json.decode(encoded_info, type=GroupInfo)
        local = msgspec.structs.replace(info, run_dir=str(replica.attach_dir))
        key_file = replica.attach_dir / KEYS_FILE
        if not key_file.exists():
            replica.keys.save(replica.attach_dir)
        write_group_info(local)
        replica.info = local

    def node_of(self, replica: RayReplica) -> str:
        return str(_ray().get(replica.actor.where.remote())[0])

    def states(self) -> dict[int, str]:
        """Per replica: "ready" when every actor of its group is, "down" when its host is dead or
        unreachable, else the first state that is not ready."""
        ray = _ray()
        states: dict[int, str] = {}
        for replica in self.replicas:
            try:
                actor_states = ray.get(replica.actor.state.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead actor, a lost node, a timeout: all down
                states[replica.index] = "down"
                continue
            bad = [state for state in actor_states.values() if state != "ready"]
            states[replica.index] = bad[0] if bad else "ready"
        return states

    def refresh(self, replica: RayReplica, timeout: float = 300.0) -> GroupInfo:
        """After Ray restarted a replica's host: its new endpoints into the attach directory."""
        self._attach(replica, _ray().get(replica.actor.info.remote(), timeout=timeout))
        assert replica.info is not None
        return replica.info

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> RayReplicaSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cluster_gpus(ray: Any) -> float:
    return float(ray.cluster_resources().get("GPU", 0.0))


def _close(ray: Any, remove_placement_group: Any, group: Any, replicas: list[RayReplica], shutdown_ray: bool) -> None:
    for replica in replicas:
        try:
            ray.get(replica.actor.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - already dead: its children watch their parent and exit
            pass
        try:
            ray.kill(replica.actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
        shutil.rmtree(replica.attach_dir, ignore_errors=True)
    try:
        remove_placement_group(group)
    except Exception:  # noqa: BLE001
        pass
    if shutdown_ray:
        ray.shutdown()
