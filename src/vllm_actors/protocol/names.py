"""Actor names and id conventions: the one place that spells them.

Messages are addressed to actor names (``SCHEDULER``, ``WORKER``, ...); ``BUS`` is the address of
events and ``CLIENT`` the address of outputs for the process that holds the frontend (never on the
wire). Worker ranks are ``worker-<rank>``. A request with ``n > 1`` fans out into engine requests
``<id>#0``, ``<id>#1``, ...

Request ids (``request_id_error``, ``engine_request_id_error``): a client's id is 1 to
``MAX_REQUEST_ID_LENGTH`` characters of ``REQUEST_ID_CHARACTERS`` (RFC 3986's unreserved characters
plus ``:``, which covers UUIDs, OpenAI's ``chatcmpl-...`` and trace ids); never ``#``, which
separates an ``n > 1`` request's children, so ``"y#1"`` can never be taken for a child of ``"y"``.
The ids travel in every per-step event: their length bounds what a client can make the bus and the
metrics store carry. An engine request id is a client's id, or a child id ``<id>#<index>``. The
frontend checks the first, the scheduler the second (anything may arrive on its socket).
"""

from __future__ import annotations

import hashlib
import re

SCHEDULER = "scheduler"
KV_CACHE_MANAGER = "kv_cache_manager"
WORKER = "worker"
FRONTEND = "frontend"
METRICS = "metrics"
BUS = "bus"
CLIENT = "client"
SUPERVISOR = "supervisor"  # the process group's parent: publishes failures and restarts
# The launcher of Ray-placed replicas (runtime/ray_launch.py): tells the controller of hosts down
# and back, on a connection of its own (never the supervisor's identity: the controller's ROUTER
# hands an identity over to the newest connection, and the supervisor's would lose its own).
RAY_LAUNCHER = "ray_launcher"
CONTROLLER = "controller"  # a replica set's router (data_parallel_size > 1): the clients' entry point

CHILD_SEPARATOR = "#"  # n>1 children of request "r" are "r#0", "r#1", ...


MAX_REQUEST_ID_LENGTH = 128
REQUEST_ID_CHARACTERS = "A-Z a-z 0-9 - . _ ~ :"
_REQUEST_ID = re.compile(rf"[A-Za-z0-9._:~-]{{1,{MAX_REQUEST_ID_LENGTH}}}")
_CHILD_INDEX = re.compile(r"[0-9]{1,9}")


def describe_request_id(request_id: str, keep: int = 40) -> str:
    """An id as error messages and log lines quote it: its start and its length when it is long,
    so that a 60 KB id is never copied into an error, a log line or an event."""
    if len(request_id) <= keep:
        return repr(request_id)
    return f"{request_id[:keep]!r}... ({len(request_id)} characters)"


def request_id_error(request_id: object) -> str | None:
    """Why ``request_id`` cannot be a client's request id, or None."""
    if not isinstance(request_id, str):
        return f"request_id must be a string, got {type(request_id).__name__}"
    if _REQUEST_ID.fullmatch(request_id):
        return None
    if not request_id:
        return "request_id must not be empty"
    if len(request_id) > MAX_REQUEST_ID_LENGTH:
        return (f"request_id must be at most {MAX_REQUEST_ID_LENGTH} characters, got {len(request_id)}: "
                f"{describe_request_id(request_id)}")
    return (f"request_id may hold only the characters {REQUEST_ID_CHARACTERS} ('{CHILD_SEPARATOR}' separates "
            f"the children of an n > 1 request), got {describe_request_id(request_id)}")


_DERIVED_KEEP = 64  # characters of a client's id a derived engine id keeps (then "~" and a digest)
_NOT_ID_CHARACTER = re.compile(r"[^A-Za-z0-9._:~-]")


def fit_request_id(value: str) -> str:
    """``value`` when it is a valid request id, else an id derived from it alone: its first
    characters (others than ``REQUEST_ID_CHARACTERS`` as ``_``), ``~`` and a digest of the whole.
    The HTTP server's ids (``cmpl-<X-Request-Id>``) go through it: vLLM bounds neither the length
    nor the characters of the header, which the response still quotes as sent."""
    if _REQUEST_ID.fullmatch(value):
        return value
    digest = hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
    return f"{_NOT_ID_CHARACTER.sub('_', value[:_DERIVED_KEEP])}~{digest}"


def engine_request_id_error(engine_id: object) -> str | None:
    """Why ``engine_id`` cannot be an engine request id (a client's id, or ``<id>#<index>``)."""
    if isinstance(engine_id, str) and CHILD_SEPARATOR in engine_id:
        parent, _, index = engine_id.rpartition(CHILD_SEPARATOR)
        if not _CHILD_INDEX.fullmatch(index):
            return f"request_id: a child's index after '{CHILD_SEPARATOR}' must be a number, got " \
                   f"{describe_request_id(engine_id)}"
        return request_id_error(parent)
    return request_id_error(engine_id)


def worker_id(rank: int) -> str:
    return f"{WORKER}-{rank}"


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}{CHILD_SEPARATOR}{index}"


def parent_request_id(engine_id: str) -> str:
    """The client's request id of an engine request (``"r#1"`` -> ``"r"``; ``"r"`` -> ``"r"``)."""
    return engine_id.rsplit(CHILD_SEPARATOR, 1)[0]


ENGINE_ACTORS = frozenset({SCHEDULER, KV_CACHE_MANAGER, METRICS, BUS, SUPERVISOR, CONTROLLER})
# The actor clients send requests to: a restart of it has lost their requests (they re-submit).
ENTRY_ACTORS = frozenset({SCHEDULER, CONTROLLER})
REPLICA_ACTORS = frozenset({SCHEDULER, KV_CACHE_MANAGER})  # with the workers: one set per replica

# Replicas (data_parallel_size > 1): each replica's scheduler, KV-cache manager and workers carry
# the replica index after REPLICA_SEPARATOR ("scheduler@1", "worker-0@1"); with one replica the
# names stay bare ("scheduler" is replica 0). The bus topic and the metrics store's actor are that
# name, so an event's replica is read from its publisher's id (``replica_of``), which the bus
# vouches for: nobody else can publish under it.
REPLICA_SEPARATOR = "@"
_REPLICA_INDEX = re.compile(r"0|[1-9][0-9]{0,3}")


def replica_actor(name: str, replica: int | None) -> str:
    """The id of actor ``name`` (``SCHEDULER``, ``KV_CACHE_MANAGER``, ``worker-<rank>``) in replica
    ``replica``; None: the bare name (a group of one replica)."""
    return name if replica is None else f"{name}{REPLICA_SEPARATOR}{replica}"


def split_replica(actor_id: str) -> tuple[str, int | None]:
    """(the actor's name within its replica, its replica index or None when it has none)."""
    name, separator, index = actor_id.rpartition(REPLICA_SEPARATOR)
    if separator and _REPLICA_INDEX.fullmatch(index) and _is_replica_actor(name):
        return name, int(index)
    return actor_id, None


def replica_of(actor_id: str) -> int | None:
    """The replica an engine actor belongs to: its index after ``@``; 0 for the bare name of a
    replica's actor (a single-replica group); None for the set's own actors (bus, metrics store,
    supervisor, controller) and for clients."""
    name, replica = split_replica(actor_id)
    if replica is not None:
        return replica
    return 0 if _is_replica_actor(name) else None


def _is_replica_actor(name: str) -> bool:
    return name in REPLICA_ACTORS or name == WORKER or name.startswith(f"{WORKER}-")


def is_worker(actor_id: str) -> bool:
    """Whether the actor is a worker rank (of any replica)."""
    name = split_replica(actor_id)[0]
    return name == WORKER or name.startswith(f"{WORKER}-")


def is_engine_actor(actor_id: str) -> bool:
    """Whether an actor id belongs to the group itself (its processes and the supervisor), not to
    a client: only the group's own processes may publish under these ids (clients publish as
    ``frontend-...``, probes as ``probe-...``). Replica actors' ids (``scheduler@1``) are engine
    actors' too."""
    name, _ = split_replica(actor_id)
    return name in ENGINE_ACTORS or _is_replica_actor(name)
