"""The worker: keeps each running request's tokens and block table, runs the step, samples.

Pure state machine around a model runner (the clock that times a step is injected):
``handle(StepPlan)`` returns one ``StepResult`` for the scheduler. Because the worker appends
every token it samples to the request's own token list, a decode step needs nothing from the plan
but the request id - the next step's input is already here.

With ``defer=True`` (the process shell's choice; ``deferred.py``) a plan whose rows need nothing
read back but their tokens is launched before the previous step's tokens are read: ``handle``
then returns the previous step's result, and the shell calls ``flush`` when no plan is waiting.

Structured outputs (``grammar.py``, injected as ``grammars``): a constrained request gets a matcher
when admitted (a resumed one replays its outputs into it); before the draw its row's logits are
masked to what the grammar allows, and each token it samples goes to its matcher before the next
mask. In a deferred step the matchers take the pending step's tokens after the forward pass is
launched (``_feed_grammars``), so the host reads them and fills the masks while the GPU runs.

Penalties read per-request counts kept on the device (the sampler's ``PenaltyPool``): a penalised
request gets a slot when admitted and gives it back when dropped.

Under tensor parallelism every rank's worker gets every plan and keeps the same requests and
block tables; each runs its shard of the forward pass (the collectives are inside the model), only
rank 0 samples, and its chosen ids are broadcast to the other ranks (which need them as the next
step's inputs). Only rank 0 answers the scheduler and publishes step events: the others return
nothing, so the scheduler waits for one reply per step whatever the group's size.

A ``reset`` plan (the pipeline restarts after an actor was restarted) first drops every request
and block-table row; its result carries ``reset`` back to the scheduler. The KV tensors are left
as they are: every request comes back as new and recomputes what it reads. A plan with a step id
below the last reset plan's was planned before it (its blocks may be someone else's now) and is
dropped without running.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_actors.actors.worker.block_tables import BlockTableArray
from vllm_actors.actors.worker.deferred import DeferredInputs, HostCopies, PendingStep
from vllm_actors.actors.worker.model_runner import BatchInput
from vllm_actors.actors.worker.plan_checks import check_plan
from vllm_actors.actors.worker.prompt_logprobs import PromptSpan, prompt_logprobs_of
from vllm_actors.actors.worker.ranks import Ranks, SingleRank
from vllm_actors.actors.worker.sampler import Sampler, SamplingRow
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.protocol.events import StepFinished, StepStarted
from vllm_actors.protocol.messages import Logprobs, Message, NewRequest, StepPlan, StepResult
from vllm_actors.protocol.names import BUS, SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams, StructuredOutputs


class Runner(Protocol):
    def execute(self, batch: BatchInput) -> torch.Tensor: ...


class RowGrammar(Protocol):
    def consume(self, token_id: int) -> None: ...


class GrammarSource(Protocol):
    """Structured outputs (``grammar.Grammars``): a matcher per constrained request, compiled off
    the step's thread; the constrained rows' logits masked before the draw."""

    def start(self, spec: StructuredOutputs, replay: Sequence[int] = ()) -> RowGrammar: ...

    def mask(self, logits: torch.Tensor, rows: list[Any], row_index: list[int]) -> None: ...


@dataclass
class WorkerRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    params: SamplingParams
    eos_token_ids: list[int]
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    row: int = -1  # its row in the worker's BlockTableArray
    num_pending: int = 0  # tokens sampled by launched steps, not read back yet
    grammar: RowGrammar | None = None  # its structured-output matcher, when constrained
    penalty_slot: int = -1  # its slot in the sampler's PenaltyPool, when it sets penalties

    @property
    def wants_prompt_logprobs(self) -> bool:
        # Not after a preemption: the prompt's logprobs were delivered on the first pass.
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def min_tokens_stop_ids(self) -> list[int]:
        if self.params.min_tokens == 0:
            return []
        eos = [] if self.params.ignore_eos else self.eos_token_ids
        return [*eos, *self.params.stop_token_ids]

    def sampling_row(self) -> SamplingRow:
        """What the sampler reads of it for the token being drawn."""
        return SamplingRow(self.params, self.num_output_tokens, self.min_tokens_stop_ids, self.token_ids,
                           self.num_prompt_tokens, self.penalty_slot)


class Worker:
    name = "worker"

    def __init__(
        self, runner: Runner, sampler: Sampler, clock: Callable[[], float], defer: bool = False,
        grammars: GrammarSource | None = None, await_reset: bool = False, tp_graph_draws: bool = True,
    ) -> None:
        """``clock``: seconds (the shell passes ``time.perf_counter``), to time each step.
        ``defer``: launch a step before reading the previous one back, where the runner can take
        input ids from the device (``supports_deferred_inputs``). ``grammars``: structured outputs
        (without, a constrained request is rejected). ``await_reset``: drop every plan until a
        reset plan (a restarted tensor-parallel rank: a plan queued for its predecessor may reach
        it and not its peers, and a step run by one rank alone would hang the group).
        ``tp_graph_draws``: under tensor parallelism, every rank draws a sampling decode graph's
        tokens itself (False: rank 0 draws every step and broadcasts)."""
        self.graph_draws_under_tp = tp_graph_draws
        self.grammars = grammars
        self._await_reset = await_reset
        self.defer = defer and bool(getattr(runner, "supports_deferred_inputs", False))
        self._pending: PendingStep | None = None
        self._copies = HostCopies()
        self.runner = runner
        self.tp: Ranks = getattr(runner, "tp", None) or SingleRank()
        self.sampler = sampler
        self.clock = clock
        self.requests: dict[str, WorkerRequest] = {}
        width = getattr(runner, "max_blocks_per_seq", None)
        self.tables = BlockTableArray(width) if width else None
        self._min_step_id = 0  # step id of the last reset plan: older plans are stale

    def handle(self, message: Message) -> list[tuple[str, Any]]:
        if not isinstance(message, StepPlan):
            raise TypeError(f"the worker does not take {type(message).__name__}")
        if message.step_id < self._min_step_id and not message.reset:
            return []  # planned before the pipeline reset: its blocks may be someone else's now
        if self._await_reset and not message.reset:
            return []
        self._await_reset = False
        self.validate(message)
        started = self._started(message)
        if self.defer and self._deferrable(message):
            # A step already done is read back first: its result goes out at once, and the GPU
            # is idle anyway. One still running is read back after this plan is launched.
            outputs = self.flush() if self.pending_ready() else []
            launched = self._launch(message, started)
            outputs += self.flush()
            self._pending = launched
            return outputs
        outputs = self.flush()
        return outputs + self._outputs(started, self.execute(message))

    @staticmethod
    def _started(plan: StepPlan) -> StepStarted:
        return StepStarted(
            step_id=plan.step_id,
            num_seqs=len(plan.req_ids),
            num_tokens=sum(plan.num_tokens),
            num_prefill_seqs=sum(1 for new in plan.new_requests if new.request_id in plan.req_ids),
        )

    def _outputs(self, started: StepStarted, result: StepResult) -> list[tuple[str, Any]]:
        if self.tp.rank != 0:
            return []  # rank 0 answers for the group
        finished = StepFinished(
            step_id=result.step_id,
            num_seqs=started.num_seqs,
            num_tokens=result.num_batched_tokens,
            num_sampled=len(result.req_ids),
            execute_ms=result.execute_seconds * 1e3,
        )
        return [(SCHEDULER, result), (BUS, started), (BUS, finished)]

    # ------------------------------------------------------------------ deferred steps
    def has_pending(self) -> bool:
        return self._pending is not None

    def pending_ready(self) -> bool:
        return self._pending is None or self._pending.ready()

    def flush(self) -> list[tuple[str, Any]]:
        """Read the launched step back: its result and events (nothing when none is pending)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        self._feed_grammars(pending)
        token_ids = pending.token_ids()
        for request, token_id in zip(pending.samplers, token_ids, strict=True):
            request.token_ids.append(token_id)
            request.num_pending -= 1
        result = StepResult(
            step_id=pending.step_id,
            req_ids=[request.request_id for request in pending.samplers],
            token_ids=token_ids,
            num_batched_tokens=pending.num_batched_tokens,
            execute_seconds=self.clock() - pending.started_at,
        )
        return self._outputs(pending.started, result)

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

    def _deferrable(self, plan: StepPlan) -> bool:
        """Whether every row's draw is all the step needs (no logprobs to read back)."""
        if plan.reset:
            return False
        if any(self.sampler.needs_host(new.params) for new in plan.new_requests):
            return False
        return not any(
            self.sampler.needs_host(self.requests[request_id].params)
            for request_id in plan.req_ids
            if request_id in self.requests and request_id not in plan.finished_ids
        )

    def _launch(self, plan: StepPlan, started: StepStarted) -> PendingStep:
        """Run the step and draw its tokens, leaving them on the device; input ids that the
        pending step sampled are taken from its sampled ids there."""
        started_at = self.clock()
        self._apply_membership(plan)
        pending = self._pending
        batch, samplers, sample_rows, _ = self._build_batch(plan, pending)
        if not batch.token_ids:
            empty = torch.empty(0, dtype=torch.long)
            return PendingStep(plan.step_id, started_at, started, [], empty, empty, None, 0)
        rows = [request.sampling_row() for request in samplers]
        in_graph = getattr(self.runner, "samples_in_graph", None)
        sampling = None
        if in_graph is not None and (self.graph_draws_under_tp or not self.tp.enabled) and in_graph(batch):
            # Under TP every rank draws in its own graph from the same all-gathered logits with
            # the same keys: the same ids everywhere, no broadcast and no eager sampler on rank 0.
            sampling = self.sampler.graph_params(rows)
        if sampling is not None:  # one replay runs the step and draws its tokens
            chosen = self.runner.execute_sampled(batch, sampling)  # type: ignore[attr-defined]
        else:
            logits = self.runner.execute(batch)
            if sample_rows != list(range(logits.shape[0])):
                logits = logits.index_select(0, upload(sample_rows, logits.device))
            constrained = [index for index, request in enumerate(samplers) if request.grammar is not None]
            if constrained and self.grammars is not None and self.tp.rank == 0:
                self._feed_grammars(pending)  # the masks follow every token drawn so far
                self.grammars.mask(logits, [samplers[i].grammar for i in constrained], constrained)
            chosen = self._draw(logits, rows)
        host, done = self._copies.start(chosen)
        for request in samplers:
            request.num_output_tokens += 1
            request.num_pending += 1  # 2 until the previous step (launched before) is read back
        row_of = {request.request_id: row for row, request in enumerate(samplers)}
        return PendingStep(
            plan.step_id, started_at, started, samplers, chosen, host, done, len(batch.token_ids), row_of
        )

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The chosen ids on the device: drawn by rank 0, broadcast to the others."""
        if self.tp.rank != 0:
            self.sampler.follow_draw(rows)
            return self.tp.broadcast(torch.empty(len(rows), dtype=torch.long, device=logits.device))
        chosen = self.sampler.draw(logits, rows).long()
        return self.tp.broadcast(chosen)

    def validate(self, plan: StepPlan) -> None:
        """Reject a plan that names unknown requests or asks for tokens that do not exist
        (``MessageRejected``), before any state changes (``plan_checks.check_plan``)."""
        check_plan(plan, self.requests, has_grammars=self.grammars is not None,
                   num_blocks=getattr(self.runner, "num_blocks", None),
                   table_width=self.tables.width if self.tables is not None else None)

    def _drop(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and self.tables is not None:
            self.tables.remove(request.row)
        if request is not None and request.penalty_slot >= 0:
            self.sampler.penalties.remove(request_id)

    def _admit(self, new: NewRequest) -> None:
        self._drop(new.request_id)
        token_ids = new.token_list()
        grammar = None
        if new.params.structured_outputs is not None and self.grammars is not None:
            # A resumed request (preempted, or resubmitted) replays its outputs into a fresh matcher.
            grammar = self.grammars.start(new.params.structured_outputs, token_ids[new.num_prompt_tokens:])
        penalty_slot = -1
        if new.params.has_penalties:
            penalty_slot = self.sampler.penalties.add(
                new.request_id, token_ids[: new.num_prompt_tokens], token_ids[new.num_prompt_tokens:])
        self.requests[new.request_id] = WorkerRequest(
            penalty_slot=penalty_slot,
            request_id=new.request_id,
            token_ids=token_ids,
            grammar=grammar,
            num_prompt_tokens=new.num_prompt_tokens,
            num_output_tokens=new.num_output_tokens,
            params=new.params,
            eos_token_ids=list(new.eos_token_ids),
            num_computed_tokens=new.num_cached_tokens,  # a prefix-cache hit: its KV is in the table
            row=self.tables.add() if self.tables is not None else -1,
        )

    def reset(self) -> None:
        """Drop every request and block-table row (a reset plan: the pipeline starts over; the
        KV tensors are left as they are, nothing will read them before it writes them)."""
        self.requests.clear()
        self.sampler.penalties.clear()
        if self.tables is not None:
            self.tables = BlockTableArray(self.tables.width)

    def _apply_membership(self, plan: StepPlan) -> None:
        if plan.reset:
            self.reset()
            self._min_step_id = plan.step_id
        for request_id in plan.finished_ids:
            self._drop(request_id)
        for new in plan.new_requests:
            self._admit(new)

    def _build_batch(
        self, plan: StepPlan, pending: PendingStep | None = None
    ) -> tuple[BatchInput, list[WorkerRequest], list[int], list[PromptSpan]]:
        """The step's flattened inputs; a token the pending step sampled becomes a placeholder
        filled on the device from that step's sampled ids."""
        batch = BatchInput([], [], [], [], [], [])
        samplers: list[WorkerRequest] = []
        sample_rows: list[int] = []  # rows of the logits that are sampled
        spans: list[PromptSpan] = []
        deferred_index: list[int] = []
        deferred_row: list[int] = []
        for request_id, num_new, new_blocks in zip(
            plan.req_ids, plan.num_tokens, plan.new_block_ids, strict=True
        ):
            request = self.requests[request_id]
            request.block_table.extend(new_blocks)
            if self.tables is not None:
                self.tables.append(request.row, new_blocks)
            start = request.num_computed_tokens
            end = start + num_new
            known = len(request.token_ids)
            if end > known + request.num_pending:
                raise ValueError(f"{request_id}: asked to compute {end} tokens, {known} known")
            flat_start = len(batch.token_ids)
            batch.token_ids.extend(request.token_ids[start:end])
            if end > known:  # the last input is the token the pending step sampled
                if pending is None or pending.row_of.get(request_id) is None:
                    raise ValueError(f"{request_id}: its last token is pending in no launched step")
                batch.token_ids.append(0)
                deferred_index.append(len(batch.token_ids) - 1)
                deferred_row.append(pending.row_of[request_id])
            batch.positions.extend(range(start, end))
            batch.query_lens.append(num_new)
            batch.seq_lens.append(end)
            batch.block_tables.append(request.block_table)
            if request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
                last = min(end, request.num_prompt_tokens - 1)
                spans.append(PromptSpan(request, len(batch.logits_indices), start + 1, last - start))
                batch.logits_indices.extend(range(flat_start, flat_start + last - start))
            request.num_computed_tokens = end
            if end == known + request.num_pending:
                samplers.append(request)
                sample_rows.append(len(batch.logits_indices))
                batch.logits_indices.append(flat_start + num_new - 1)
        if deferred_index and pending is not None:
            batch.deferred = DeferredInputs(deferred_index, pending.chosen, deferred_row)
        if batch.token_ids and self.tables is not None:
            batch.block_table_array = self.tables.gather(
                [self.requests[request_id].row for request_id in plan.req_ids]
            )
        return batch, samplers, sample_rows, spans

    def execute(self, plan: StepPlan) -> StepResult:
        started = self.clock()
        self._apply_membership(plan)
        batch, samplers, sample_rows, spans = self._build_batch(plan)
        if not batch.token_ids:
            return StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=[], token_ids=[])
        logits = self.runner.execute(batch)
        if self.tp.rank != 0:
            return self._follow(plan, batch, samplers, logits)

        prompt_logprobs = [prompt_logprobs_of(span, logits) for span in spans]
        rows = [request.sampling_row() for request in samplers]
        if samplers and sample_rows != list(range(logits.shape[0])):
            # not when every row samples (decode): no copy of batch x vocab
            logits = logits.index_select(0, upload(sample_rows, logits.device))
        constrained = [index for index, request in enumerate(samplers) if request.grammar is not None]
        if constrained and self.grammars is not None:  # structured outputs: disallowed tokens to -inf
            self.grammars.mask(logits, [samplers[i].grammar for i in constrained], constrained)
        sampled = self.sampler(logits, rows) if samplers else None
        token_ids = sampled.token_ids if sampled else []
        if self.tp.enabled and samplers:  # the other ranks take their next inputs from these
            self.tp.broadcast(upload(token_ids, logits.device))
        for request, token_id in zip(samplers, token_ids, strict=True):
            request.token_ids.append(token_id)
            request.num_output_tokens += 1
            if request.grammar is not None:  # the matcher sees the token here, before the next step
                request.grammar.consume(token_id)
        logprobs: list[Logprobs | None] = []
        if sampled and any(entry is not None for entry in sampled.logprobs):
            logprobs = sampled.logprobs
        return StepResult(
            step_id=plan.step_id,
            reset=plan.reset,
            req_ids=[request.request_id for request in samplers],
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            num_batched_tokens=len(batch.token_ids),
            execute_seconds=self.clock() - started,
        )

    def _follow(self, plan: StepPlan, batch: BatchInput, samplers: list[WorkerRequest],
                logits: torch.Tensor) -> StepResult:
        """A rank above 0: take the ids rank 0 drew; no sampling, no logprobs."""
        token_ids: list[int] = []
        if samplers:
            self.sampler.follow_draw([request.sampling_row() for request in samplers])
            received = torch.empty(len(samplers), dtype=torch.long, device=logits.device)
            token_ids = self.tp.broadcast(received).tolist()
        for request, token_id in zip(samplers, token_ids, strict=True):
            request.token_ids.append(token_id)
            request.num_output_tokens += 1
        return StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=[r.request_id for r in samplers],
                          token_ids=token_ids, num_batched_tokens=len(batch.token_ids))
