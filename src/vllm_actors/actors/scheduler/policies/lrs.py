"""``lrs``: least remaining slack first: deadline - now - predicted remaining work (the step cost
model's). ``now`` is the same for every request of a pass, so ordering by deadline - remaining work
gives the same order: no clock needed. Requests without a deadline last; the most slack is
preempted first: when KV blocks run short, and when every sequence slot is taken and a waiting
request has less slack (``KeyedPolicy.slot_victims``)."""

from __future__ import annotations

from vllm_actors.actors.scheduler.deadlines import first_token_seconds, remaining_seconds
from vllm_actors.actors.scheduler.policies.base import KeyedPolicy
from vllm_actors.actors.scheduler.request import ScheduledRequest


class LeastRemainingSlack(KeyedPolicy):
    name = "lrs"
    preempts_for_slots = True
    batch = 1  # decoding sequences the predictions assume: the running batch's size at this pass

    def begin_pass(self, step: int, num_running: int) -> None:
        super().begin_pass(step, num_running)
        self.batch = max(1, num_running)

    def key(self, request: ScheduledRequest) -> tuple[float, ...]:
        slack = self.slack(request)
        return (1, 0.0, request.arrival) if slack is None else (0, slack, request.arrival)

    def slack(self, request: ScheduledRequest) -> float | None:
        """The least of its deadlines' slacks (less ``now``): a TTFT deadline against the work up to
        its first token (its prefill), the end-to-end one against all its remaining work. Weighing
        a TTFT deadline against the whole decode would rank a long request that has seconds to its
        first token above a stream whose tokens are due now."""
        slacks = []
        if request.ttft_deadline is not None and not request.output_token_ids:
            slacks.append(request.ttft_deadline - first_token_seconds(request, self.cost, self.batch))
        if request.e2e_deadline is not None:
            slacks.append(request.e2e_deadline - remaining_seconds(request, self.cost, self.batch))
        return min(slacks, default=None)
