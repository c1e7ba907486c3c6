"""Who may publish what: a client (any publisher that is no engine actor) publishes only client
events; what the store does not apply is counted per (publisher, why) and noticed sparingly."""

from __future__ import annotations

from vllm_actors.actors.metrics_store.notices import Notice, Untrusted
from vllm_actors.protocol.events import (
    Aborted,
    ActorCrashed,
    ActorDraining,
    ActorReady,
    ActorStarting,
    ActorStopped,
    Arrived,
    Event,
    Finished,
    Heartbeat,
)

MAX_REJECTION_KEYS = 1_000  # (publisher, why) pairs counted; the oldest are forgotten

# What a client (any publisher whose id is no engine actor's: ``frontend-...``, ``probe-...``) may
# publish: its requests' arrival, their end where the frontend ends them (a stop string; an
# error or abort on its side), heartbeats and its own lifecycle (which touches only its own
# entry). Anything else from a client is not applied: a KV_POOL, STEP_FINISHED or TOKENS under
# a client id would still move the gauges.
CLIENT_EVENTS: tuple[type, ...] = (Arrived, Finished, Aborted, Heartbeat,
                                   ActorStarting, ActorReady, ActorDraining, ActorStopped, ActorCrashed)
CLIENT_FINISH_REASONS = frozenset({"stop", "error"})


def client_may_publish(event: Event) -> bool:
    if isinstance(event, Finished):
        return event.reason in CLIENT_FINISH_REASONS
    return isinstance(event, CLIENT_EVENTS)




def _noticed(count: int) -> bool:
    """1, 10, 100, ...: how often a repeated notice is worth a log line."""
    while count >= 10 and count % 10 == 0:
        count //= 10
    return count == 1


class Rejections:
    """Rejections counted per (publisher, why); a notice on the 1st, 10th, 100th... one."""

    def __init__(self, notices: list[Notice]) -> None:
        self._counts: dict[tuple[str, str], int] = {}
        self._notices = notices

    def count(self, publisher: str, claimed: str, why: str, count: int) -> None:
        key = (publisher, why)
        total = self._counts[key] = self._counts.get(key, 0) + count
        if len(self._counts) > MAX_REJECTION_KEYS:  # bounded: forget the oldest keys
            del self._counts[next(iter(self._counts))]
        if _noticed(total):
            self._notices.append(Untrusted(publisher=publisher[:64], claimed=claimed[:64], why=why, count=total))
