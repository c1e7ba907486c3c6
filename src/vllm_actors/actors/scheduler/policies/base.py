"""The queue interface every scheduling policy implements: ``order_waiting`` returns the waiting
queue in admission order; ``order_running`` sorts the running batch in place, most urgent first
(the scheduler serves it in that order and preempts the last one). The deadline policies (edf,
lrs: ``preempts_for_slots``) also take sequence slots: with every slot (``max_num_seqs``) taken,
a waiting request that outranks the least urgent running one has it preempted (``slot_victims``),
so that a burst of long batch requests cannot hold every slot while deadlines pass behind them.
``priority`` keeps vLLM's rule: it preempts only when KV blocks run short."""

from __future__ import annotations

from collections import deque

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.cost_model import CostModel
from vllm_actors.actors.scheduler.request import ScheduledRequest


class QueuePolicy:
    """The base: both queues left as they are (arrival order)."""

    name = ""
    step = 0  # the scheduler's step count, set before each pass (aging's clock)

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost

    def order_waiting(self, waiting: deque[ScheduledRequest], ledger: BlockLedger) -> deque[ScheduledRequest]:
        return waiting

    def order_running(self, running: list[ScheduledRequest]) -> None:
        return None


class KeyedPolicy(QueuePolicy):
    """A policy that is a sort key, on both queues (stable: equal keys keep their order). A
    request still waiting for a token in flight goes last in the waiting queue: it cannot be
    admitted yet and must not block the others."""

    preempts_for_slots = False  # a waiting request that outranks a running one takes its slot

    def key(self, request: ScheduledRequest) -> tuple[float, ...]:
        raise NotImplementedError

    def order_waiting(self, waiting: deque[ScheduledRequest], ledger: BlockLedger) -> deque[ScheduledRequest]:
        if len(waiting) < 2:
            return waiting
        return deque(sorted(waiting, key=lambda r: (r.num_pending > 0, *self.key(r))))

    def order_running(self, running: list[ScheduledRequest]) -> None:
        running.sort(key=self.key)

    def outranks(self, waiting: ScheduledRequest, running: ScheduledRequest) -> bool:
        """Strictly more urgent by the policy's key (no aging: waiting longer earns a free slot,
        not another request's)."""
        return self.key(waiting) < self.key(running)


def slot_victims(policy: QueuePolicy, waiting: deque[ScheduledRequest], running: list[ScheduledRequest],
                 max_num_seqs: int, budget: int) -> list[ScheduledRequest]:
    """The running requests to preempt so that waiting ones that outrank them get their slots:
    ``waiting`` in admission order and ``running`` most urgent first (both as the policy ordered
    them). Only candidates this step can admit count: not waiting for a token in flight, and
    their prefill within the step's token ``budget`` together. Empty but for a policy that
    ``preempts_for_slots``."""
    if not isinstance(policy, KeyedPolicy) or not policy.preempts_for_slots:
        return []
    free = max_num_seqs - len(running)
    victims: list[ScheduledRequest] = []
    tail = len(running) - 1
    for candidate in waiting:
        if candidate.num_pending:
            continue
        budget -= max(1, candidate.num_tokens - candidate.num_computed_tokens)
        if budget < 0:
            break
        if free > 0:
            free -= 1
            continue
        if tail < 0 or not policy.outranks(candidate, running[tail]):
            break
        victims.append(running[tail])
        tail -= 1
    return victims
