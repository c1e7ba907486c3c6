"""The worker's request table as a plan changes it: the plan checked against it first (``validate``),
a pipeline stage's input tokens appended, requests dropped when they finish (their drafter state,
host-tier fences, block-table row and penalties with them), their draft-only blocks trimmed, new ones
admitted (``Worker._admit`` builds each), everything dropped on a reset plan (``Worker`` mixes this
in; ``_apply_membership`` runs first in every plan)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_actors.actors.worker.block_tables import BlockTableArray
from vllm_actors.actors.worker.plan_checks import check_plan

if TYPE_CHECKING:
    from vllm_actors.actors.worker.borrowing_hooks import BorrowingHooks
    from vllm_actors.actors.worker.copy_fences import CopyFences
    from vllm_actors.actors.worker.engine import GrammarSource, HostTierCopies, Proposer, Runner, TokenSampler
    from vllm_actors.actors.worker.ranks import Stage
    from vllm_actors.actors.worker.step_data import WorkerRequest
    from vllm_actors.protocol.messages import NewRequest, StepPlan


class Membership:
    """The plan's checks, and admission, drops, trims and resets of ``Worker``'s requests."""

    if TYPE_CHECKING:  # provided by Worker
        requests: dict[str, WorkerRequest]
        tables: BlockTableArray | None
        drafter: Proposer | None
        host_tier: HostTierCopies | None
        grammars: GrammarSource | None
        runner: Runner
        sampler: TokenSampler
        stage: Stage
        borrowing: BorrowingHooks | None
        _fences: CopyFences
        _min_step_id: int

        def _admit(self, new: NewRequest) -> None: ...  # the request's state, built by Worker

    def _take_input_tokens(self, plan: StepPlan) -> None:
        """Under pipeline parallelism a decoding request's input token comes with the plan: a
        stage that did not sample it (all but the last) appends it. The last one has it from its own
        step, read back or still pending (a deferred step: appended at its read-back; a TP rank other
        than the one that answers may read it back after the next plan is here)."""
        if self.stage.is_last:
            return
        for request_id, token_id in plan.input_token_ids.items():
            request = self.requests.get(request_id)
            if request is not None and len(request.token_ids) == request.num_computed_tokens:
                request.token_ids.append(token_id)

    def validate(self, plan: StepPlan) -> None:
        """Reject a plan that names unknown requests or asks for tokens that do not exist
        (``MessageRejected``), before any state changes (``plan_checks.check_plan``)."""
        check_plan(plan, self.requests, has_grammars=self.grammars is not None, num_blocks=self.runner.num_blocks,
                   table_width=self.tables.width if self.tables is not None else None,
                   num_host_blocks=self.host_tier.num_blocks if self.host_tier is not None else 0)

    def _drop(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(request_id)
        if request is not None and self.host_tier is not None:
            self._fences.release(request.block_table)
        if request is not None and self.tables is not None:
            self.tables.remove(request.row)
        if request is not None and request.penalty_slot >= 0:
            self.sampler.penalties.remove(request_id)

    def reset(self) -> None:
        """Drop every request and block-table row (a reset plan: the pipeline starts over; the
        KV tensors are left as they are, nothing will read them before it writes them)."""
        self.requests.clear()
        if self.drafter is not None:
            self.drafter.clear()
        self._fences.reset()
        self.sampler.penalties.clear()
        if self.tables is not None:
            self.tables = BlockTableArray(self.tables.width)

    def _apply_membership(self, plan: StepPlan) -> None:
        if plan.reset:
            self.reset()
            self._min_step_id = plan.step_id
        for request_id in plan.finished_ids:
            self._drop(request_id)
        for request_id, keep in plan.trimmed_blocks.items():  # blocks that held rejected drafts only
            request = self.requests[request_id]
            del request.block_table[keep:]
            if self.tables is not None:
                self.tables.truncate(request.row, keep)
        for new in plan.new_requests:
            self._admit(new)
        if self.borrowing is not None:
            self.borrowing.apply(plan, self.requests, self.tables)
