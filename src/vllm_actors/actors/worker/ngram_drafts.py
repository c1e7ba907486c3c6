"""N-gram drafts proposed in the worker, just before the step verifies them.

The scheduler plans an n-gram request's drafts as ``WORKER_DRAFT`` placeholders (how many it may
take) with two steps in flight: when it plans step N+1, step N's tokens are unknown to it, but not
to the worker, which has read step N back (a drafting step is read back at once) before it builds
N+1. Here the placeholders are filled with the n-gram proposal over the request's tokens
(``protocol/ngram.py``). Where the lookup finds fewer drafts than planned, the request verifies
only those it found (``draft_slots.with_drafts`` shortens its tokens): with none it is a plain
decode row, and a step where no request found one is a plain step, which the worker may launch with
two steps in flight. The scheduler still rolls back the planned slots (``StepResult.num_drafted``).

Before reading the step in flight back, ``without_hopeless`` checks whether any lookup could find a
draft whatever the pending token is: a suffix of ``n >= min_n`` tokens ending with it occurs earlier
only if its ``min_n - 1`` known tokens do. Where none can, the plan runs as a plain step at once,
launched before the step in flight is read back (the two steps stay overlapped). The requests it
found hopeless before the first that may find one are not looked up again when that step runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from vllm_actors.actors.worker.draft_slots import placeholder_counts, short_drafts, with_found
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.ngram import latest_match, propose_ngram
from vllm_actors.protocol.token_ids import pack_token_ids

if TYPE_CHECKING:  # the type only: this module runs without torch
    from vllm_actors.actors.worker.step_data import WorkerRequest


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self._packed: dict[str, bytes] = {}  # request id -> its tokens packed so far (they only grow)
        # (step id, request id -> its tokens once its pending ones are read back): requests whose
        # lookup ``without_hopeless`` found must come up empty in that step (``propose`` skips them)
        self._hopeless: tuple[int, dict[str, int]] = (-1, {})

    def forget(self, request_id: str) -> None:
        self._packed.pop(request_id, None)

    def clear(self) -> None:
        self._packed.clear()
        self._hopeless = (-1, {})

    def _packed_tokens(self, request: WorkerRequest) -> bytes:
        """The request's tokens packed as int32, only those added since its last proposal packed."""
        packed = self._packed.get(request.request_id, b"")
        size = len(request.token_ids)
        if len(packed) == 4 * size:  # packed already (without_hopeless, then this step's lookup)
            return packed
        if len(packed) > 4 * size:
            packed = b""
        packed += pack_token_ids(request.token_ids[len(packed) // 4:])
        self._packed[request.request_id] = packed
        return packed

    def propose(self, plan: StepPlan, requests: Mapping[str, WorkerRequest]) -> StepPlan:
        """The plan with its ``WORKER_DRAFT`` placeholders replaced by the n-gram drafts found."""
        counts = placeholder_counts(plan)
        if not counts:
            return plan
        step_id, hopeless = self._hopeless
        if step_id != plan.step_id:
            hopeless = {}
        self._hopeless = (-1, {})
        found: dict[str, list[int]] = {}
        min_n, max_n = self.min_n, self.max_n
        for request_id, num_drafts in counts.items():
            request = requests[request_id]
            if hopeless.get(request_id) == len(request.token_ids) and not request.num_pending:
                continue  # nothing to find, whatever its pending token turned out to be
            drafts = propose_ngram(self._packed_tokens(request), num_drafts, min_n, max_n)
            if drafts:
                found[request_id] = drafts
        return with_found(plan, counts, found)

    def could_find(self, request: WorkerRequest) -> bool:
        """Whether its lookup may find a draft once its pending token (at most one) is known."""
        packed = self._packed_tokens(request)
        if request.num_pending == 0:
            return bool(propose_ngram(packed, 1, self.min_n, self.max_n))
        known = len(packed) // 4
        if request.num_pending > 1:
            return True
        if known < self.min_n:  # fewer than min_n + 1 tokens with the pending one
            return False
        if self.min_n < 2:  # the pending token alone may have occurred before
            return True
        return latest_match(packed, self.min_n - 1) >= 0  # its known tokens of the suffix, followed by one

    def without_hopeless(self, plan: StepPlan,
                         requests: Mapping[str, WorkerRequest]) -> tuple[StepPlan, dict[str, int]] | None:
        """The plan as a plain step and its drafted counts (0 each), where every placeholder's
        lookup must find nothing; None where one may find drafts (or the plan has drafts given).
        The requests found hopeless before the first that may find one are remembered for ``propose``."""
        counts = placeholder_counts(plan)
        if not counts or len(counts) != len(plan.draft_token_ids):
            return None
        hopeless: dict[str, int] = {}
        for request_id in counts:
            request = requests[request_id]
            if self.could_find(request):
                self._hopeless = (plan.step_id, hopeless)
                return None
            hopeless[request_id] = len(request.token_ids) + request.num_pending
        plain = with_found(plan, counts, {})
        return plain, short_drafts(plan, plain)
