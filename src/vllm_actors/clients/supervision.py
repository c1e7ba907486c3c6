"""Where the clients meet the supervisor: the one place that knows its API.

A client that owns its process group (the offline ``LLM``, ``serve``'s ``AsyncEngineClient``)
learns of restarts and of the group's failure from ``ProcessGroup`` listeners (called on the
supervisor's monitor thread) and reads each actor's state from ``ProcessGroup.state()``: facts of
the supervisor's own, which no event on the bus can forge. An attached client (no group of its
own) follows the supervisor's events on the bus instead (``SupervisionView``), trusting only
batches published by "supervisor" under its own topic.

The supervisor's contract (``runtime/supervisor.py``)::

    group.on_restart(callback)   # callback(actor_id), once a restarted child is READY again
    group.on_failure(callback)   # callback(reason), when the group gives up (it then shuts down)
    group.state()                # {actor id: "ready" | "restarting" | "failed"}
    group.failed                 # the reason, once the group has failed; else None

A ``ProcessGroup`` without these (no supervisor) is handled as before: an exited actor is fatal.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.protocol.events import ActorFailed, ActorRestarted, EventBatch, GroupFailed
from vllm_actors.protocol.names import CONTROLLER, KV_CACHE_MANAGER, SCHEDULER, SUPERVISOR, WORKER, split_replica

READY = "ready"
RESTARTING = "restarting"
FAILED = "failed"
EXITED = "exited"  # the process has exited and the supervisor has not reported it yet


def is_critical(actor: str) -> bool:
    """Actors without which no request can be served: the step pipeline (and a replica set's
    controller). The bus and the metrics store are not (serving goes on while they restart:
    degraded)."""
    name, _ = split_replica(actor)
    return name in (SCHEDULER, KV_CACHE_MANAGER, CONTROLLER) or name.startswith(WORKER + "-")


# --------------------------------------------------------------------------- an owned group
def supervised(group: object) -> bool:
    """Whether the group has a supervisor that restarts its actors."""
    return callable(getattr(group, "on_restart", None))


def listen(group: object, on_restart: Callable[[str], None], on_failure: Callable[[str], None]) -> bool:
    """Register the listeners (called on the supervisor's thread: they must only hand over). Bound
    methods are held weakly: a client that is gone is not kept alive by the group it listened to.
    False when the group has no supervisor."""
    if not supervised(group):
        return False
    group_any: Any = group
    group_any.on_restart(_weakly(on_restart))
    group_any.on_failure(_weakly(on_failure))
    return True


def _weakly(callback: Callable[[str], None]) -> Callable[[str], None]:
    if not hasattr(callback, "__self__"):
        return callback
    method = weakref.WeakMethod(callback)  # type: ignore[arg-type]

    def call(argument: str) -> None:
        target = method()
        if target is not None:
            target(argument)

    return call


def group_failure(group: object) -> str | None:
    """Why the group failed, or None while it serves (or restarts)."""
    failed = getattr(group, "failed", None)
    return failed if isinstance(failed, str) else None


def group_states(group: object) -> dict[str, str]:
    """Each actor's state as the supervisor knows it, and "exited" for a process that has exited
    before the supervisor noticed (a group without a supervisor: "ready" or "exited")."""
    group_any: Any = group
    alive: Mapping[str, bool] = group_any.alive()
    state = getattr(group, "state", None)
    states: dict[str, str] = dict(state()) if callable(state) else dict.fromkeys(alive, READY)
    for actor, is_alive in alive.items():
        if not is_alive and states.get(actor, READY) == READY:
            states[actor] = EXITED
    return states




# --------------------------------------------------------------------------- an attached client
@dataclass
class SupervisionView:
    """What an attached client knows of the supervisor, from its events on the bus: actors reported
    failed and not restarted yet, and the group's failure. Batches not published by the supervisor
    under its own topic are ignored."""

    down: dict[str, str] = field(default_factory=dict)  # actor -> "restarting" (ACTOR_FAILED's how/detail)
    failed: str | None = None

    def on_batch(self, topic: str, batch: EventBatch) -> tuple[list[str], str | None]:
        """Apply one batch; returns (actors restarted, the group's failure reason if it failed now)."""
        if topic != SUPERVISOR or batch.actor != SUPERVISOR:
            return [], None
        restarted: list[str] = []
        failed_now: str | None = None
        for event in batch.events:
            if isinstance(event, ActorFailed):
                self.down[event.actor] = f"{RESTARTING} ({event.how}: {event.detail})"
            elif isinstance(event, ActorRestarted):
                self.down.pop(event.actor, None)
                restarted.append(event.actor)
            elif isinstance(event, GroupFailed) and self.failed is None:
                self.failed = failed_now = event.reason
        return restarted, failed_now


# --------------------------------------------------------------------------- health
@dataclass
class Health:
    """``/health``'s verdict: "ok" and "degraded" serve (200); "unavailable" (the step pipeline is
    down or restarting, the client shut down) and "failed" (the group gave up) do not (503)."""

    status: str
    unhealthy: dict[str, str] = field(default_factory=dict)  # what stops serving, per part
    degraded: dict[str, str] = field(default_factory=dict)  # what is down while serving goes on

    @property
    def serving(self) -> bool:
        return self.status in ("ok", "degraded")

    def problems(self) -> dict[str, str]:
        return {**self.degraded, **self.unhealthy}


def classify(states: Mapping[str, str], *, failure: str | None = None,
             extra_unhealthy: Mapping[str, str] | None = None) -> Health:
    """A verdict from each part's state ("ready" or what is wrong with it)."""
    if failure is not None:
        return Health("failed", {"group": f"failed: {failure}"})
    unhealthy = dict(extra_unhealthy or {})
    degraded: dict[str, str] = {}
    # A replica set serves while one replica's pipeline is whole: the others' troubles degrade it.
    replicas = {split_replica(actor)[1] for actor in states} - {None}
    down = {split_replica(actor)[1] for actor, state in states.items() if state != READY and is_critical(actor)}
    some_replica_up = bool(replicas - down)
    for actor, state in states.items():
        if state != READY:
            replica = split_replica(actor)[1]
            critical = is_critical(actor) and not (replica is not None and some_replica_up)
            (unhealthy if critical else degraded)[actor] = state
    if unhealthy:
        return Health("unavailable", unhealthy, degraded)
    return Health("degraded" if degraded else "ok", {}, degraded)


def is_scheduler(topic: str) -> bool:
    """A scheduler's topic on the bus: the group's, or a replica's ("scheduler@1")."""
    return split_replica(topic)[0] == SCHEDULER


def call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: object) -> None:
    """Hand a call from the supervisor's thread to the loop (dropped once the loop is closed)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        pass
