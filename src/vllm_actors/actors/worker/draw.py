"""A step's draw as the worker makes it: the plan's drafts filled in and checked by the grammars, the
decode graph's sampling inputs where the graph draws itself, the structured-output masks, and rank 0's
draw broadcast to the other ranks (``Worker`` mixes this in)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vllm_actors.actors.worker.draft_slots import grammar_checked, short_drafts
from vllm_actors.actors.worker.engine import GrammarSource, Proposer, Runner, TokenSampler
from vllm_actors.actors.worker.ranks import Ranks
from vllm_actors.actors.worker.step_data import (
    BatchInput,
    GraphSampling,
    PendingStep,
    SamplingRow,
    StepBatch,
    WorkerRequest,
)
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.protocol.messages import Logprobs, StepPlan


class Draw:
    """The draw of ``Worker``'s step body."""

    if TYPE_CHECKING:  # provided by Worker
        runner: Runner
        sampler: TokenSampler
        grammars: GrammarSource | None
        tp: Ranks
        graph_draws_under_tp: bool
        drafter: Proposer | None
        requests: dict[str, WorkerRequest]
        _pending: PendingStep | None

    def _with_drafts(self, plan: StepPlan, num_drafted: dict[str, int]) -> tuple[StepPlan, dict[str, int]]:
        """The plan with the drafter's tokens for its placeholders, cut before the first draft a
        constrained request's grammar refuses; ``num_drafted`` with the requests left short."""
        planned = plan
        if self.drafter is not None and plan.draft_token_ids:
            plan = self.drafter.propose(plan, self.requests)
        if self.grammars is not None and any(self.requests[request_id].grammar is not None
                                             for request_id in plan.draft_token_ids):
            self._feed_grammars(self._pending)  # from the state after every token drawn so far
            plan = grammar_checked(plan, self.requests)
        return plan, {**num_drafted, **short_drafts(planned, plan)} if plan is not planned else num_drafted

    def _graph_sampling(self, batch: BatchInput, rows: list[SamplingRow]) -> GraphSampling | None:
        """The draw's inputs where a decode graph can draw this step's tokens itself. Under TP
        every rank draws in its own graph from the same all-gathered logits with the same keys:
        the same ids everywhere, no broadcast and no eager sampler on rank 0."""
        if self.tp.enabled and not self.graph_draws_under_tp:
            return None
        if not self.runner.samples_in_graph(batch):
            return None
        return self.sampler.graph_params(rows)

    def _verifies_in_graph(self, step: StepBatch) -> bool:
        """Whether a step read back at once may still draw in the decode graph: a verification step
        (its ids read back for the verification) whose every logits row samples and none of whose
        requests wants logprobs or prompt logprobs."""
        return bool(step.drafts) and not step.spans and len(step.sample_rows) == len(step.batch.logits_indices) \
            and not any(self.sampler.needs_host(request.params) for request in step.samplers)

    def _mask(self, logits: torch.Tensor, samplers: list[WorkerRequest], pending: PendingStep | None,
              rows: list[SamplingRow] | None = None) -> None:
        """Structured outputs: the constrained rows' disallowed tokens to -inf (a verification row's
        from its grammar's state after the drafts before it, ``SamplingRow.drafted``)."""
        if self.grammars is None or all(request.grammar is None for request in samplers):
            return
        self._feed_grammars(pending)  # the masks follow every token drawn so far (which may start a grammar)
        masked = [index for index, request in enumerate(samplers)
                  if request.grammar is not None and request.grammar.active]
        if masked:
            drafted = [rows[index].drafted for index in masked] if rows is not None else None
            self.grammars.mask(logits, [samplers[index].grammar for index in masked], masked, drafted)

    def _count_kept(self, kept_by: list[WorkerRequest], kept: list[int]) -> None:
        """A verification read back at once: the tokens kept counted in their penalised requests'
        slots (its draw counted none), on rank 0: the rank that draws."""
        if self.tp.rank != 0:
            return
        slots = [(request.penalty_slot, token) for request, token in zip(kept_by, kept, strict=True)
                 if request.penalty_slot >= 0]
        if slots:
            self.sampler.penalties.count_kept([slot for slot, _ in slots], [token for _, token in slots])

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], with_logprobs: bool,
              count: bool = True) -> tuple[torch.Tensor | list[int], list[Logprobs | None]]:
        """The chosen ids, drawn by rank 0 and broadcast to the others: on the host with their
        logprobs (``with_logprobs``), else left on the device; ``count``: as ``Sampler.draw``'s."""
        if not rows:  # deferred: on the step's device, so the step is fenced as one that draws (HostCopies)
            return torch.empty(0, dtype=torch.long, device=None if with_logprobs else logits.device), []
        if self.tp.rank != 0:
            self.sampler.follow_draw(rows)
            return self.tp.broadcast(torch.empty(len(rows), dtype=torch.long, device=logits.device)), []
        if not with_logprobs:
            return self.tp.broadcast(self.sampler.draw(logits, rows, count).long()), []
        sampled = self.sampler(logits, rows, count)
        if self.tp.enabled:  # the other ranks take their next inputs from these
            self.tp.broadcast(upload(sampled.token_ids, logits.device))
        logprobs = sampled.logprobs if any(entry is not None for entry in sampled.logprobs) else []
        return sampled.token_ids, logprobs

    @staticmethod
    def _feed_grammars(pending: PendingStep | None) -> None:
        """The pending step's tokens to its constrained requests' matchers, once (waits for them
        on the host: a deferred step with a constrained row does so after its forward pass is
        launched, so the GPU runs it while the host reads the tokens and fills the masks)."""
        if pending is None or pending.grammars_fed:
            return
        pending.grammars_fed = True
        if not any(request.grammar is not None for request in pending.samplers):
            return
        for request, token_id in zip(pending.samplers, pending.token_ids(), strict=True):
            if request.grammar is not None:
                request.grammar.consume(token_id)
