"""The one exception a state machine raises on purpose."""

from __future__ import annotations

# The prefix of a scheduler's refusal of a request whose deadline cannot be met (admission
# control, ``reject_unmeetable``): the server answers it with a 503, not a 400.
UNMEETABLE_DEADLINE = "unmeetable deadline"


class MessageRejected(ValueError):
    """The message fails validation against the actor's state (a plan naming unknown requests, a
    plan the KV-cache manager's blocks disagree with, a step result nobody waits for): it is
    rejected whole, before anything changed. The shell logs it, publishes ``REJECTED`` on the bus
    and keeps serving. Any other exception out of ``handle`` is a bug: the actor crashes."""
