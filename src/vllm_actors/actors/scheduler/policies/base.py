"""The interface every scheduling policy implements, and the sort-key policies' common part.

``order_waiting`` returns the waiting queue in admission order; ``order_running`` sorts the running
batch in place, most urgent first (the scheduler serves it in that order and preempts the last
one). ``begin_pass`` tells the policy where the scheduler stands before each planning pass. Two
questions the scheduler asks: ``queue_ahead`` (admission control: which waiting requests would be
admitted before an arriving one) and ``slot_victims`` (which running requests give their sequence
slots to more urgent waiting ones). The deadline policies (edf, lrs: ``preempts_for_slots``) take
slots that way, so that a burst of long batch requests cannot hold every slot (``max_num_seqs``)
while deadlines pass behind them; ``priority`` keeps vLLM's rule: it preempts only when KV blocks
run short."""

from __future__ import annotations

from collections import deque

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.cost_model import CostModel
from vllm_actors.actors.scheduler.request import ScheduledRequest


class QueuePolicy:
    """The base: both queues left as they are (arrival order); nobody preempted for a slot."""

    name = ""
    preempts_for_slots = False  # a waiting request that outranks a running one takes its slot

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.step = 0  # the scheduler's step count at the current pass (aging's clock)

    def begin_pass(self, step: int, num_running: int) -> None:
        """Before a planning pass: the scheduler's step count and the running batch's size."""
        self.step = step

    def order_waiting(self, waiting: deque[ScheduledRequest], ledger: BlockLedger) -> deque[ScheduledRequest]:
        return waiting

    def order_running(self, running: list[ScheduledRequest]) -> None:
        return None

    def queue_ahead(self, waiting: deque[ScheduledRequest], arriving: ScheduledRequest) -> list[ScheduledRequest]:
        """The waiting requests that would be admitted before ``arriving`` (admission control's
        queue ahead): all of them, unless the policy orders by a key."""
        return list(waiting)

    def outranks(self, waiting: ScheduledRequest, running: ScheduledRequest) -> bool:
        """Whether a waiting request goes before a running one: never, unless the policy orders
        both queues by one key."""
        return False

    def slot_victims(self, waiting: deque[ScheduledRequest], running: list[ScheduledRequest],
                     max_num_seqs: int, budget: int) -> list[ScheduledRequest]:
        """The running requests to preempt so that waiting ones that outrank them get their slots
        (``waiting`` and ``running`` as the policy ordered them): none, unless the policy
        ``preempts_for_slots``."""
        return []


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

    def outranks(self, waiting: ScheduledRequest, running: ScheduledRequest) -> bool:
        """Strictly more urgent by the policy's key (no aging: waiting longer earns a free slot,
        not another request's)."""
        return self.key(waiting) < self.key(running)

    def queue_ahead(self, waiting: deque[ScheduledRequest], arriving: ScheduledRequest) -> list[ScheduledRequest]:
        """Those whose key is not after the arriving request's."""
        key = self.key(arriving)
        return [request for request in waiting if self.key(request) <= key]

    def slot_victims(self, waiting: deque[ScheduledRequest], running: list[ScheduledRequest],
                     max_num_seqs: int, budget: int) -> list[ScheduledRequest]:
        """Only candidates this step can admit count: not waiting for a token in flight, and their
        prefill within the step's token ``budget`` together."""
        if not self.preempts_for_slots:
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
            if tail < 0 or not self.outranks(candidate, running[tail]):
                break
            victims.append(running[tail])
            tail -= 1
        return victims
