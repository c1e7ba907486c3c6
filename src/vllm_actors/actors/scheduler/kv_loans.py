"""A lender's side of borrowed KV capacity (``protocol/kv_loans.py``): the blocks its scheduler
reserves for other replicas' requests.

A loan asked for (``LendKv``) waits until the ledger has its blocks available (free, or idle cached
ones it evicts); while one waits, the scheduler admits no waiting request of its own (its running
ones go on, and free blocks as they end), so a loan is granted at the latest once they have. A
granted loan is a holding of the ledger under ``loan_key``, held by no running request: never
preempted, and its blocks are not evictable. Each plan names the loans granted and returned since
the last (``StepPlan.loans``, ``returned_loans``); the KV-cache manager takes or frees the blocks
and publishes ``KV_LENT`` / ``KV_RETURNED``. A pipeline reset (a fresh pool) asks for every granted
loan again. Pure bookkeeping: no I/O, no clock.
"""

from __future__ import annotations

from collections import OrderedDict

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.protocol.kv_loans import LendKv, ReturnKv, loan_key
from vllm_actors.protocol.messages import StepPlan


class LoanDesk:
    def __init__(self) -> None:
        self.pending: OrderedDict[str, int] = OrderedDict()  # request id -> blocks, in arrival order
        self.granted: dict[str, int] = {}
        self._new: dict[str, int] = {}  # granted since the last plan
        self._returned: list[str] = []  # ended since the last plan (their blocks already free here)
        # On a home: requests announced to run on borrowed blocks (``BorrowKv``), until their AddRequest
        self.guests: dict[str, list[list[int]]] = {}

    @property
    def has_news(self) -> bool:
        """Something for the next plan: a loan to grant, or granted or returned loans to name."""
        return bool(self.pending or self._new or self._returned)

    @property
    def admits(self) -> bool:
        """Whether the scheduler may admit its own waiting requests (no loan waits for blocks)."""
        return not self.pending

    def ledger_keys(self) -> set[str]:
        return {loan_key(request_id) for request_id in self.granted}

    def handle(self, message: LendKv | ReturnKv, ledger: BlockLedger) -> None:
        if isinstance(message, LendKv):
            if message.num_blocks < 1:
                raise ValueError(f"a loan of {message.num_blocks} blocks for {message.request_id!r}: at least 1")
            if message.request_id not in self.pending and message.request_id not in self.granted:
                self.pending[message.request_id] = message.num_blocks  # a repeat (a resend) is one loan
            return
        if self.pending.pop(message.request_id, None) is not None:
            return  # never granted: nothing was reserved
        if self.granted.pop(message.request_id, None) is None:
            return  # unknown (a late return): nothing to free
        ledger.release(loan_key(message.request_id))
        if self._new.pop(message.request_id, None) is None:
            self._returned.append(message.request_id)  # else never named to the KV-cache manager

    def grant(self, ledger: BlockLedger) -> None:
        """Reserve the waiting loans, in arrival order, while the ledger has their blocks."""
        while self.pending:
            request_id, count = next(iter(self.pending.items()))
            if count > ledger.num_available:
                return
            del self.pending[request_id]
            key = loan_key(request_id)
            ledger.admit(key, None)
            ledger.allocate(key, count)
            self.granted[request_id] = count
            self._new[request_id] = count

    def fill(self, plan: StepPlan) -> None:
        """Name the loans granted and returned since the last plan in ``plan``."""
        plan.loans, plan.returned_loans = self._new, self._returned
        self._new, self._returned = {}, []

    def reset(self) -> None:
        """The pipeline starts over with a fresh pool (the ledger's too): every granted loan is
        asked for again, ahead of the ones still waiting."""
        again = OrderedDict(self.granted)
        again.update(self.pending)
        self.pending, self.granted, self._new, self._returned = again, {}, {}, []
