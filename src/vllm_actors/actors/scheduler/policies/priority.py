"""``priority``: vLLM's: ``(priority, arrival)``, lower first; the running request preempted when
KV blocks run short is the one with the highest priority value, latest arrival (vLLM v1's
``max(running, key=(priority, arrival_time))``). Running requests also take the step's token budget
in that order, so a short budget leaves the lowest priorities out of the step.

Starvation freedom: aging. A waiting request's effective priority drops by one for every
``AGING_STEPS`` steps it has waited, so under a bounded arrival rate of better-priority work a
low-priority request's effective priority eventually beats every newcomer's, and it is admitted.
Steps, not seconds: the scheduler stays free of clocks."""

from __future__ import annotations

from collections import deque

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.policies.base import KeyedPolicy
from vllm_actors.actors.scheduler.request import ScheduledRequest

AGING_STEPS = 64  # steps waited per unit of priority gained


class Priority(KeyedPolicy):
    name = "priority"

    def key(self, request: ScheduledRequest) -> tuple[float, ...]:
        return (request.priority, request.arrival)

    def order_waiting(self, waiting: deque[ScheduledRequest], ledger: BlockLedger) -> deque[ScheduledRequest]:
        if len(waiting) < 2:
            return waiting

        def aged(request: ScheduledRequest) -> tuple[float, ...]:
            waited = max(0, self.step - request.queued_at_step)
            return (request.num_pending > 0, request.priority - waited // AGING_STEPS, request.arrival)

        return deque(sorted(waiting, key=aged))
