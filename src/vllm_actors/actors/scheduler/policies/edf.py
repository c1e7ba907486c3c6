"""``edf``: earliest absolute deadline (the earliest of a request's TTFT and end-to-end deadlines)
first; requests without a deadline after those with one, in arrival order. The running request
with the latest deadline is preempted first: when KV blocks run short, and when every sequence
slot is taken and a waiting request's deadline is earlier than its own (``KeyedPolicy.slot_victims``)."""

from __future__ import annotations

from vllm_actors.actors.scheduler.policies.base import KeyedPolicy
from vllm_actors.actors.scheduler.request import ScheduledRequest


class EarliestDeadlineFirst(KeyedPolicy):
    name = "edf"
    preempts_for_slots = True

    def key(self, request: ScheduledRequest) -> tuple[float, ...]:
        if request.deadline is None:
            return (1, 0.0, request.arrival)
        return (0, request.deadline, request.arrival)
