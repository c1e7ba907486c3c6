"""The scheduling policies behind one interface (``base.QueuePolicy``), one module each: each
orders the waiting queue (who is admitted first) and the running batch (who gets the step's token
budget first; the last one is preempted when KV blocks run short), so the budget is shared between
prefill chunks and decodes by the policy's order, not by a fixed rule: ``fcfs``, ``lpm``,
``priority`` (with aging), ``edf``, ``lrs``."""

from __future__ import annotations

from vllm_actors.actors.scheduler.cost_model import CostModel
from vllm_actors.actors.scheduler.policies.base import KeyedPolicy, QueuePolicy
from vllm_actors.actors.scheduler.policies.edf import EarliestDeadlineFirst
from vllm_actors.actors.scheduler.policies.fcfs import FirstComeFirstServed
from vllm_actors.actors.scheduler.policies.lpm import LongestPrefixMatch
from vllm_actors.actors.scheduler.policies.lrs import LeastRemainingSlack
from vllm_actors.actors.scheduler.policies.priority import AGING_STEPS, Priority

POLICIES: dict[str, type[QueuePolicy]] = {
    policy.name: policy
    for policy in (FirstComeFirstServed, LongestPrefixMatch, Priority, EarliestDeadlineFirst, LeastRemainingSlack)
}

__all__ = ["AGING_STEPS", "POLICIES", "KeyedPolicy", "QueuePolicy", "make_policy"]


def make_policy(name: str, cost: CostModel) -> QueuePolicy:
    return POLICIES[name](cost)
