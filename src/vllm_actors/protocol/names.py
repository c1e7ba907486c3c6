"""Actor names and id conventions: the one place that spells them.

Messages are addressed to actor names (``SCHEDULER``, ``WORKER``, ...); ``BUS`` is the address of
events and ``CLIENT`` the address of outputs for the process that holds the frontend (never on the
wire). Worker ranks are ``worker-<rank>``. A request with ``n > 1`` fans out into engine requests
``<id>#0``, ``<id>#1``, ...
"""

from __future__ import annotations

SCHEDULER = "scheduler"
KV_CACHE_MANAGER = "kv_cache_manager"
WORKER = "worker"
FRONTEND = "frontend"
METRICS = "metrics"
BUS = "bus"
CLIENT = "client"
SUPERVISOR = "supervisor"  # the process group's parent: publishes failures and restarts

CHILD_SEPARATOR = "#"  # n>1 children of request "r" are "r#0", "r#1", ...


def worker_id(rank: int) -> str:
    return f"{WORKER}-{rank}"


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}{CHILD_SEPARATOR}{index}"


def parent_request_id(engine_id: str) -> str:
    """The client's request id of an engine request (``"r#1"`` -> ``"r"``; ``"r"`` -> ``"r"``)."""
    return engine_id.rsplit(CHILD_SEPARATOR, 1)[0]


ENGINE_ACTORS = frozenset({SCHEDULER, KV_CACHE_MANAGER, METRICS, BUS, SUPERVISOR})


def is_engine_actor(actor_id: str) -> bool:
    """Whether an actor id belongs to the group itself (its processes and the supervisor), not to
    a client: only the group's own processes may publish under these ids (clients publish as
    ``frontend-...``, probes as ``probe-...``)."""
    return actor_id in ENGINE_ACTORS or actor_id.startswith(f"{WORKER}-")
