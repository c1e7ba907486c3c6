"""The controller's placement of a request beside routing (``routing.Router``): sent to the replica
chosen (``Routed``), placed on a home with loans asked of its lenders first (``kv_loans``, through
``borrowing.Borrowing``) and held until each lender confirmed, its loans given back when it ends, and
the requests a pull router holds sent when a replica frees a slot (``Controller`` mixes this in)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm_actors.protocol.events import Aborted, Routed
from vllm_actors.protocol.messages import AddRequest, RequestUpdate, RequestUpdates
from vllm_actors.protocol.names import FRONTEND
from vllm_actors.protocol.outputs import Outputs

if TYPE_CHECKING:
    from vllm_actors.actors.controller.borrowing import Borrowing
    from vllm_actors.actors.controller.routing import Router


@dataclass
class OpenRequest:
    """A request the controller holds: as the client sent it, where it runs, the tokens forwarded."""

    add: AddRequest
    replica: int | None  # None: waiting in the controller for a slot (pull)
    output_token_ids: list[int] = field(default_factory=list)


class Placement:
    """Where ``Controller`` sends each request, and when."""

    if TYPE_CHECKING:  # provided by Controller
        router: Router
        borrowing: Borrowing | None
        requests: dict[str, OpenRequest]
        num_replicas: int

        def scheduler_of(self, replica: int) -> str: ...

    def _place(self, add: AddRequest) -> Outputs | None:
        """A request too long for some replica's pool: on its home, with loans asked of its lenders
        first (None: the router decides; refused when it fits nowhere, even borrowing)."""
        assert self.borrowing is not None
        views = self.router.replicas
        candidates = [r for r, view in enumerate(views) if view.up] or list(range(self.num_replicas))
        placed = self.borrowing.place(add, candidates, [view.in_flight for view in views])
        if placed is None:
            return None
        if placed.refused is not None:
            del self.requests[add.request_id]
            placed.out.emit(Aborted(request_id=add.request_id, reason="error"))
            refusal = RequestUpdate(request_id=add.request_id, finish_reason="error", error=placed.refused)
            placed.out.send(FRONTEND, RequestUpdates(step_id=-1, updates=[refusal]))
            return placed.out
        home = self.borrowing.home_of(add.request_id)
        views[home].in_flight += 1
        if self.router.policy == "pull" and home in self.router.slots:
            self.router.slots.remove(home)  # its slot, given back when the request ends
        if placed.home is None:  # held here until every lender's KV_LENT (``observe``)
            return placed.out
        return placed.out.extend(self._send(add.request_id, home, "largest_pool", 0))

    def _lent(self, replica: int, request_id: str) -> Outputs:
        """A lender confirmed its loan: a request whose lenders all did goes to its home, which
        learns its lenders right before it."""
        out = self.borrowing.lent(replica, request_id) if self.borrowing is not None else None
        if out is None:
            return Outputs()
        assert self.borrowing is not None
        return out.extend(self._send(request_id, self.borrowing.home_of(request_id), "borrowed", 0))

    def _loans_back(self, request_id: str) -> Outputs:
        """The request ended: its lenders' blocks go back."""
        return self.borrowing.back(request_id) if self.borrowing is not None else Outputs()

    def _send(self, request_id: str, replica: int, reason: str, cached_blocks: int) -> Outputs:
        request = self.requests[request_id]
        request.replica = replica
        outputs = Outputs()
        outputs.send(self.scheduler_of(replica), request.add)
        outputs.emit(Routed(request_id=request_id, replica=replica, reason=reason, num_cached_blocks=cached_blocks))
        return outputs

    def _released(self, replica: int) -> Outputs:
        out = Outputs()
        for request, decision in self.router.release(replica):
            if request.request_id in self.requests:
                out += self._send(request.request_id, decision.replica, decision.reason, decision.cached_blocks)
        return out
