"""The queue interface every scheduling policy implements: ``order_waiting`` returns the waiting
queue in admission order; ``order_running`` sorts the running batch in place, most urgent first
(the scheduler serves it in that order and preempts the last one)."""

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

    def key(self, request: ScheduledRequest) -> tuple[float, ...]:
        raise NotImplementedError

    def order_waiting(self, waiting: deque[ScheduledRequest], ledger: BlockLedger) -> deque[ScheduledRequest]:
        if len(waiting) < 2:
            return waiting
        return deque(sorted(waiting, key=lambda r: (r.num_pending > 0, *self.key(r))))

    def order_running(self, running: list[ScheduledRequest]) -> None:
        running.sort(key=self.key)
