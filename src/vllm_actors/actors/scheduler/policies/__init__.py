"""The scheduling policies behind one queue interface (``base.QueuePolicy``), one module each:
each orders the waiting queue (who is admitted first) and the running batch (who gets the step's
token budget first; the last one is preempted when KV blocks run short), so the budget is shared
between prefill chunks and decodes by the policy's order, not by a fixed rule: ``fcfs``, ``lpm``,
``priority`` (with aging), ``edf``, ``lrs``."""

from __future__ import annotations

from collections import deque

from vllm_actors.actors.scheduler.cost_model import CostModel
from vllm_actors.actors.scheduler.policies.base import KeyedPolicy, QueuePolicy, slot_victims
from vllm_actors.actors.scheduler.policies.edf import EarliestDeadlineFirst
from vllm_actors.actors.scheduler.policies.fcfs import FirstComeFirstServed
from vllm_actors.actors.scheduler.policies.lpm import LongestPrefixMatch
from vllm_actors.actors.scheduler.policies.lrs import LeastRemainingSlack
from vllm_actors.actors.scheduler.policies.priority import AGING_STEPS, Priority
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.protocol.messages import AddRequest

POLICIES: dict[str, type[QueuePolicy]] = {
    policy.name: policy
    for policy in (FirstComeFirstServed, LongestPrefixMatch, Priority, EarliestDeadlineFirst, LeastRemainingSlack)
}

__all__ = ["AGING_STEPS", "POLICIES", "KeyedPolicy", "LeastRemainingSlack", "QueuePolicy", "make_policy",
           "queue_ahead", "slot_victims"]


def make_policy(name: str, cost: CostModel) -> QueuePolicy:
    return POLICIES[name](cost)


def queue_ahead(policy: QueuePolicy, waiting: deque[ScheduledRequest], message: AddRequest,
                arrival: int) -> list[ScheduledRequest]:
    """The waiting requests that would be admitted before the arriving one (admission control's
    queue ahead): under an ordering policy those whose key is not after its key, else all."""
    if not isinstance(policy, KeyedPolicy):
        return list(waiting)
    arriving = ScheduledRequest(request_id=message.request_id, prompt_token_ids=message.prompt_token_ids,
                                params=message.params, eos_token_ids=message.eos_token_ids,
                                priority=message.priority, ttft_deadline=message.ttft_deadline,
                                e2e_deadline=message.e2e_deadline, arrival=arrival)
    key = policy.key(arriving)
    return [request for request in waiting if policy.key(request) <= key]
