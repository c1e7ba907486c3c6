"""The worker's side of an n-gram verification kept in flight while the next step launches
(``spec_overlap``; ``Worker`` mixes this in): which drafting plans are launched so
(``_verifies_later``), the plan that arrives while one is in flight run as a plain step before its
read-back (``_launch_over_verification``), its requests' counts while it is in flight (``_count_as_accepted``)
and the verification settled at its read-back (``_settle_verification``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_actors.actors.worker.ngram_drafts import NgramProposer
from vllm_actors.actors.worker.spec_overlap import plain_over_verification
from vllm_actors.actors.worker.verify import verify
from vllm_actors.protocol.outputs import Outputs

if TYPE_CHECKING:
    from vllm_actors.actors.worker.borrowing_hooks import BorrowingHooks
    from vllm_actors.actors.worker.engine import Proposer, TokenSampler
    from vllm_actors.actors.worker.ranks import Ranks, Stage
    from vllm_actors.actors.worker.step_data import PendingStep, WorkerRequest
    from vllm_actors.protocol.events import StepStarted
    from vllm_actors.protocol.messages import StepPlan


class OverlapSteps:
    """``Worker``'s verification-in-flight steps (``spec_overlap``)."""

    if TYPE_CHECKING:  # provided by Worker
        requests: dict[str, WorkerRequest]
        sampler: TokenSampler
        spec_overlap: bool
        num_overlapped_steps: int
        drafter: Proposer | None
        tp: Ranks
        stage: Stage
        borrowing: BorrowingHooks | None
        _pending: PendingStep | None

        def flush(self) -> Outputs: ...
        def _launch(self, plan: StepPlan, started: StepStarted, read_now: bool, may_defer: bool = False,
                    num_drafted: dict[str, int] | None = None) -> PendingStep: ...

    def _launch_over_verification(self, plan: StepPlan, started: StepStarted, pending: PendingStep) -> Outputs | None:
        """``plan`` launched as a plain step before ``pending`` (a verification still running) is read
        back, then ``pending`` read back; None where the plan must wait for its tokens."""
        overlapped = plain_over_verification(plan, pending, self.requests, self.sampler)
        if overlapped is None:
            return None
        launched = self._launch(overlapped[0], started, read_now=False, num_drafted=overlapped[1])
        launched.overlapped_ids = list(overlapped[1])
        self.num_overlapped_steps += 1
        outputs = self.flush()
        self._pending = launched
        return outputs

    def _verifies_later(self, plan: StepPlan) -> bool:
        """Whether a drafting plan's verification may stay in flight while the next step launches
        (``spec_overlap``): n-gram drafts in the worker, one rank and stage, no borrowed KV, no
        constrained request, no drafting one with logits controls (penalties, bias, allowed ids) and
        no row that needs the host."""
        if not self.spec_overlap or not plan.draft_token_ids or plan.reset:
            return False
        if not isinstance(self.drafter, NgramProposer):  # a draft model's or head's requests: one step in flight
            return False
        if self.tp.enabled or self.stage.enabled or self.borrowing is not None:
            return False
        if any(new.params.structured_outputs is not None or self.sampler.needs_host(new.params)
               for new in plan.new_requests):
            return False
        for request_id in plan.req_ids:
            request = self.requests.get(request_id)
            if request is None or request_id in plan.finished_ids:
                continue
            if request.grammar is not None or self.sampler.needs_host(request.params):
                return False
            if request.params.has_controls and request_id in plan.draft_token_ids:
                return False  # its kept tokens are counted from the host
        return True

    @staticmethod
    def _count_as_accepted(samplers: list[WorkerRequest], verifying: list[list[int]]) -> None:
        """A verification launched to be read back later: its requests counted as if every draft
        were accepted until then (as the scheduler plans them)."""
        for request, drafts in zip(samplers, verifying, strict=True):
            request.num_output_tokens += len(drafts)
            request.num_pending += len(drafts)

    @staticmethod
    def _settle_verification(pending: PendingStep, token_ids: list[int]) -> list[int]:
        """A verification read back after the next launch: its requests' counts (taken as if every
        draft were accepted) back to what they keep, and the tokens kept."""
        assert pending.verifying is not None
        for request, drafts in zip(pending.samplers, pending.verifying, strict=True):
            request.num_output_tokens -= 1 + len(drafts)
            request.num_pending -= 1 + len(drafts)
        pending.samplers, token_ids, _, pending.spec = verify(pending.samplers, pending.verifying, token_ids, [])
        for request in pending.samplers:
            request.num_output_tokens += 1
            request.num_pending += 1
        return token_ids
