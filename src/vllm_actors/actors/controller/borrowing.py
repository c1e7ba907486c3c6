"""The controller's side of KV borrowing: placing a request too long for a replica's pool on a home
replica with blocks lent by others, and the messages that go with the loans.

Each lender's scheduler gets ``LendKv``; the request waits (``held``) until every lender's
``KV_LENT``; the home's scheduler gets ``BorrowKv`` (its lenders and their blocks, in table order)
right before the request; each lender gets ``ReturnKv`` when the request ends. A pure state
machine beside ``Controller``, which owns the requests and sends them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_actors.actors.controller.kv_loans import LoanPlanner, LoanRefused, Placement
from vllm_actors.protocol.kv_loans import BorrowKv, LendKv, ReturnKv
from vllm_actors.protocol.messages import AddRequest
from vllm_actors.protocol.outputs import Outputs


@dataclass
class Placed:
    """Where ``Borrowing.place`` put a request: ``refused`` (fits nowhere, even borrowing), or the
    loans asked (``out``) and ``home`` when it may go there now (no lender to wait for)."""

    out: Outputs = field(default_factory=Outputs)
    home: int | None = None
    refused: str | None = None


def borrow_message(request_id: str, placement: Placement) -> BorrowKv:
    return BorrowKv(request_id=request_id, lenders=[[lender, count] for lender, count in placement.lenders.items()])


class Borrowing:
    def __init__(self, planner: LoanPlanner, scheduler_of: Callable[[int], str]) -> None:
        self.planner = planner
        self.scheduler_of = scheduler_of
        self.held: dict[str, set[int]] = {}  # borrowing requests -> lenders whose KV_LENT has not come yet

    def place(self, add: AddRequest, candidates: list[int], in_flight: Sequence[int]) -> Placed | None:
        """A request too long for some replica's pool: its home, with loans asked of its lenders first
        (None: it fits where the router sends it)."""
        needed = self.planner.blocks_needed(add.num_prompt_tokens, len(add.output_token_ids),
                                            add.params.max_tokens)
        try:
            placement = self.planner.place(add.request_id, needed, candidates, list(in_flight))
        except LoanRefused as error:
            return Placed(refused=str(error))
        if placement is None:
            return None
        placed = Placed()
        for lender, count in placement.lenders.items():
            placed.out.send(self.scheduler_of(lender), LendKv(request_id=add.request_id, home=placement.home,
                                                              num_blocks=count))
        if placement.lenders:  # held until every lender's KV_LENT (``lent``)
            self.held[add.request_id] = set(placement.lenders)
        else:
            placed.home = placement.home
        return placed

    def home_of(self, request_id: str) -> int:
        return self.planner.placements[request_id].home

    def lent(self, replica: int, request_id: str) -> Outputs | None:
        """A lender confirmed its loan: once all did, the home's ``BorrowKv`` (the request then goes
        home, ``home_of``); None while some lender has not."""
        waiting = self.held.get(request_id)
        if waiting is None:
            return None
        waiting.discard(replica)
        if waiting:
            return None
        del self.held[request_id]
        placement = self.planner.placements[request_id]
        out = Outputs()
        out.send(self.scheduler_of(placement.home), borrow_message(request_id, placement))
        return out

    def back(self, request_id: str) -> Outputs:
        """The request ended (finished or aborted): its lenders' blocks go back."""
        self.held.pop(request_id, None)
        out = Outputs()
        placement = self.planner.release(request_id)
        if placement is not None:
            for lender in placement.lenders:
                out.send(self.scheduler_of(lender), ReturnKv(request_id=request_id))
        return out

    def borrowing_of(self, request_id: str, home: int) -> BorrowKv | None:
        """What a restarted home's scheduler needs again before the request itself."""
        placement = self.planner.placements.get(request_id)
        if placement is not None and placement.lenders and placement.home == home:
            return borrow_message(request_id, placement)
        return None

    def lend_again(self, replica: int) -> Outputs:
        """A restarted lender's loans died with it: asked for again."""
        out = Outputs()
        for request_id, placement in self.planner.placements.items():
            count = placement.lenders.get(replica)
            if count is not None:
                out.send(self.scheduler_of(replica), LendKv(request_id=request_id, home=placement.home,
                                                            num_blocks=count))
        return out
