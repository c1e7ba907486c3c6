"""``lrs``: least remaining slack first: deadline - now - predicted remaining work (the step cost
model's). ``now`` is the same for every request of a pass, so ordering by deadline - remaining work
gives the same order: no clock needed. Requests without a deadline last; the most slack is
preempted first."""

from __future__ import annotations

from vllm_actors.actors.scheduler.deadlines import remaining_seconds
from vllm_actors.actors.scheduler.policies.base import KeyedPolicy
from vllm_actors.actors.scheduler.request import ScheduledRequest


class LeastRemainingSlack(KeyedPolicy):
    name = "lrs"
    batch = 1  # decoding sequences the predictions assume (the running batch's size, set each pass)

    def key(self, request: ScheduledRequest) -> tuple[float, ...]:
        if request.deadline is None:
            return (1, 0.0, request.arrival)
        return (0, request.deadline - remaining_seconds(request, self.cost, self.batch), request.arrival)
