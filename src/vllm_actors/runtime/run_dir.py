"""The run directory of a process group: private (mode 0700), short (IPC socket paths are limited
to about 100 bytes), and holding ``group.json`` - the addresses a tap or a client needs to attach.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import msgspec

from vllm_actors.envs import envs
from vllm_actors.protocol.names import (
    CONTROLLER,
    KV_CACHE_MANAGER,
    METRICS,
    SCHEDULER,
    SUPERVISOR,
    replica_actor,
    worker_id,
)
from vllm_actors.runtime.ports import PortReservation
from vllm_actors.runtime.shm_regions import remove_regions

GROUP_FILE = "group.json"


class ReplicaAddresses(msgspec.Struct, kw_only=True):
    """One replica's step pipeline (data_parallel_size > 1): its scheduler, KV-cache manager, workers."""

    scheduler: str
    kv_cache_manager: str
    workers: list[str]


class GroupAddresses(msgspec.Struct, kw_only=True):
    bus_in: str  # XSUB side of the event bus where clients PUBlish (never under an engine actor's id)
    bus_out: str  # XPUB side: the metrics store and taps SUBscribe here
    metrics: str  # the metrics store's query socket (ROUTER)
    scheduler: str  # ROUTER: clients submit and abort here
    kv_cache_manager: str
    workers: list[str]
    # One XSUB endpoint of the bus per engine actor and for the supervisor: the bus forwards only
    # batches whose topic is the endpoint's owner, so nobody else can publish under that id.
    # Kept out of group.json (``write_group_info``): clients publish on ``bus_in``.
    bus_in_actors: dict[str, str] = {}
    # A replica set (data_parallel_size > 1): ``scheduler`` is the controller's socket (the
    # clients' entry point) and each replica's pipeline is here; an actor of replica r gets a copy
    # with r's addresses in ``scheduler``, ``kv_cache_manager`` and ``workers`` (``for_replica``).
    # Kept out of group.json, as bus_in_actors.
    replicas: list[ReplicaAddresses] = []

    def for_replica(self, replica: int) -> GroupAddresses:
        """The addresses as an actor of ``replica`` sees them: its own pipeline's."""
        own = self.replicas[replica]
        return msgspec.structs.replace(self, scheduler=own.scheduler, kv_cache_manager=own.kv_cache_manager,
                                       workers=list(own.workers), replicas=[])

    def publish_address(self, actor_id: str) -> str:
        """Where ``actor_id`` publishes its events: its own endpoint, or the clients' one."""
        return self.bus_in_actors.get(actor_id, self.bus_in)


class GroupInfo(msgspec.Struct, kw_only=True):
    pid: int  # the supervisor's
    run_dir: str
    model: str
    addresses: GroupAddresses
    worker: dict[str, object] = {}  # what the worker reported: KV pool, model facts
    max_model_len: int = 0
    tokenizer: str | None = None  # where clients load the tokenizer from (None: skip_tokenizer_init)
    data_parallel_size: int = 1  # replicas; above 1, "scheduler" is the controller's address
    disable_events: bool = False  # the engine publishes no work events: its clients publish none either


def runs_root() -> Path:
    """``$VLLM_ACTORS_RUN_ROOT`` or ``/tmp/vllm-actors-<uid>``, created private."""
    root = Path(envs.VLLM_ACTORS_RUN_ROOT or f"{tempfile.gettempdir()}/vllm-actors-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    if root.stat().st_uid != os.getuid():
        raise PermissionError(f"{root} belongs to another user")
    os.chmod(root, 0o700)
    return root


OWNER_FILE = "owner.pid"  # the pid of the process that made a run directory (and removes it)


def make_run_dir() -> Path:
    """A new private run directory, owned by this process (``OWNER_FILE``). Run directories left
    by owners that died without cleaning up (a SIGKILLed supervisor, a Ray host killed by Ray)
    are removed first: they hold sockets, logs and the group's CURVE keys."""
    root = runs_root()
    sweep_orphaned_run_dirs(root)
    path = Path(tempfile.mkdtemp(prefix="g", dir=root))
    os.chmod(path, 0o700)
    (path / OWNER_FILE).write_text(str(os.getpid()))
    return path


def sweep_orphaned_run_dirs(root: Path) -> list[Path]:
    """Remove the run directories under ``root`` whose owner process is gone; returns them.
    A directory without an owner file (being made, or made by an older version) is kept, and so is
    one whose pid is taken again by another process."""
    removed = []
    for owner_file in root.glob(f"g*/{OWNER_FILE}"):
        try:
            pid = int(owner_file.read_text().strip() or "0")
        except (OSError, ValueError):
            continue
        if pid > 0 and not pid_alive(pid):
            remove_regions(owner_file.parent)
            shutil.rmtree(owner_file.parent, ignore_errors=True)
            removed.append(owner_file.parent)
    return removed


def make_addresses(run_dir: Path, num_workers: int, tcp_host: str | None = None,
                   num_replicas: int = 1, ports: PortReservation | None = None) -> GroupAddresses:
    """IPC endpoints in the run directory, or TCP endpoints on ``tcp_host`` when given, on ports
    taken from ``ports`` (a reservation the caller holds while the group runs; without one, ports
    free now and nothing more). With ``num_replicas > 1``: a controller at ``scheduler`` and one
    pipeline per replica, whose actors are named ``<name>@<replica>`` (``names.replica_actor``)."""
    indices: list[int | None] = [None] if num_replicas == 1 else list(range(num_replicas))

    def pipeline(replica: int | None) -> list[str]:
        return [replica_actor(name, replica)
                for name in (*(worker_id(rank) for rank in range(num_workers)), KV_CACHE_MANAGER, SCHEDULER)]

    replica_actors = [actor for replica in indices for actor in pipeline(replica)]
    publishers = [METRICS, *replica_actors, SUPERVISOR, *([CONTROLLER] if num_replicas > 1 else [])]
    names = ["bus_in", "bus_out", "metrics", *(["scheduler"] if num_replicas > 1 else []), *replica_actors,
             *(f"bus_in_{actor}" for actor in publishers)]
    if tcp_host is None:
        endpoints = {name: f"ipc://{run_dir}/{name}" for name in names}
    else:
        held = ports or PortReservation(tcp_host)
        if held.host != tcp_host:
            raise ValueError(f"the reservation holds ports on {held.host}, not on {tcp_host}")
        endpoints = {name: f"tcp://{tcp_host}:{port}" for name, port in zip(names, held.take(len(names)), strict=True)}
        if ports is None:
            held.close()
    replicas = [ReplicaAddresses(
        scheduler=endpoints[replica_actor(SCHEDULER, replica)],
        kv_cache_manager=endpoints[replica_actor(KV_CACHE_MANAGER, replica)],
        workers=[endpoints[replica_actor(worker_id(rank), replica)] for rank in range(num_workers)],
    ) for replica in indices]
    return GroupAddresses(
        bus_in=endpoints["bus_in"],
        bus_out=endpoints["bus_out"],
        metrics=endpoints["metrics"],
        scheduler=endpoints["scheduler"] if num_replicas > 1 else replicas[0].scheduler,
        kv_cache_manager="" if num_replicas > 1 else replicas[0].kv_cache_manager,
        workers=[] if num_replicas > 1 else replicas[0].workers,
        bus_in_actors={actor: endpoints[f"bus_in_{actor}"] for actor in publishers},
        replicas=replicas if num_replicas > 1 else [],
    )


def write_group_info(info: GroupInfo) -> None:
    """Write ``group.json`` for taps and attaching clients, without the engine actors' own bus
    endpoints (a client publishes on ``bus_in``)."""
    path = Path(info.run_dir) / GROUP_FILE
    temporary = path.with_suffix(".tmp")
    public = msgspec.structs.replace(info, addresses=msgspec.structs.replace(info.addresses, bus_in_actors={},
                                                                            replicas=[]))
    temporary.write_bytes(msgspec.json.encode(public))
    temporary.replace(path)


def read_group_info(run_dir: str | Path) -> GroupInfo:
    return msgspec.json.decode(Path(run_dir, GROUP_FILE).read_bytes(), type=GroupInfo)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (possibly another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def find_running_group() -> GroupInfo:
    """The most recently started group whose supervisor is alive."""
    candidates = sorted(runs_root().glob(f"*/{GROUP_FILE}"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        try:
            info = read_group_info(path.parent)
        except (OSError, msgspec.DecodeError):
            continue
        if pid_alive(info.pid):
            return info
    raise FileNotFoundError(f"no running vllm-actors group under {runs_root()}; pass --run-dir or --address")
