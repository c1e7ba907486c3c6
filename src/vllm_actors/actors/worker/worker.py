"""The worker: keeps each running request's tokens and block table, runs the step, samples.

A state machine around the GPU engine (``engine.py`` declares what it uses of the runner, the
sampler and the grammars; the clock that times a step is injected): ``handle(StepPlan)`` returns
one ``StepResult`` for the scheduler. The worker appends every token it samples to the request's
own token list, so a decode step needs nothing from the plan but the request id.

Every step runs one body (``_launch``): membership, batch, forward pass, grammar masks, then the
draw (rank 0) or the ids rank 0 drew (the other tensor-parallel ranks); ``_read_back`` then appends
the tokens. A step whose rows need logprobs is read back at once (``execute``). With ``defer=True``
any other step is launched before the previous one is read back, its pending input ids taken from
that step's sampled ids on the device: ``handle`` then returns the previous step's result, and the
shell calls ``flush`` when no plan is waiting (``has_pending`` / ``pending_ready`` / ``flush``).

Structured outputs: a constrained request gets a matcher when admitted (a resumed one replays its
outputs into it); its row's logits are masked before the draw, and each token it draws goes to its
matcher before the next mask (in a deferred step, after the forward pass is launched, so the host
fills the masks while the device runs). Penalties read per-request counts kept on the device: a
penalised request gets a slot in the sampler's pool when admitted and gives it back when dropped.

Under tensor parallelism every rank's worker gets every plan and keeps the same requests and block
tables; only rank 0 answers the scheduler and publishes step events. A ``reset`` plan drops every
request and block-table row first (the KV tensors are left as they are: every request comes back as
new and recomputes what it reads); a plan with a step id below the last reset's is dropped unrun.
An engine command (``EngineControl``: sleep, wake-up; ``controls``) is carried out once the step
launched before it is read back; rank 0 answers it.

GPU time (``gpu_timing``; what the worker reports of it: ``timing_reports``): on a CUDA device, a
step that samples nothing (a stage before the last, or a prefill chunk short of its prompt's end)
is read back without waiting for the device, so its host time is its launch alone; a pipeline's
last stage waits for the stages before it as well, so there every step is timed so. Rank 0 of each
stage times those on the GPU by CUDA events: their result says ``execute_seconds`` 0 (not
measured), and once complete they are published as ``STEP_TIMED`` and, on the last stage, sent in
the next result's ``gpu_timings``. The shell looks for completed ones while they are outstanding
(``has_pending`` / ``pending_ready`` / ``flush``), so a stage's last chunk is reported without
waiting for its next step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_actors.actors.worker.batch import build_batch, step_started
from vllm_actors.actors.worker.block_tables import BlockTableArray
from vllm_actors.actors.worker.borrowing_hooks import BorrowingHooks
from vllm_actors.actors.worker.controls import carry_out
from vllm_actors.actors.worker.copy_fences import CopyFences
from vllm_actors.actors.worker.deferred_steps import DeferredSteps
from vllm_actors.actors.worker.draw import Draw
from vllm_actors.actors.worker.engine import GrammarSource, HostTierCopies, Proposer, Runner, TokenSampler
from vllm_actors.actors.worker.gpu_timing import StepTimer
from vllm_actors.actors.worker.host_copies import HostCopies
from vllm_actors.actors.worker.kv_rejoin import KvRejoining, Rejoiner
from vllm_actors.actors.worker.logprobs import prompt_logprobs_of
from vllm_actors.actors.worker.membership import Membership
from vllm_actors.actors.worker.ngram_drafts import NgramProposer
from vllm_actors.actors.worker.overlap_steps import OverlapSteps
from vllm_actors.actors.worker.ranks import OnlyStage, Ranks, Stage
from vllm_actors.actors.worker.spec_overlap import accepted_counts, first_rows, overlap_rows
from vllm_actors.actors.worker.step_data import (
    PendingStep,
    WorkerRequest,
)
from vllm_actors.actors.worker.timing_reports import TimingReports
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.actors.worker.verify import expand_rows, verify
from vllm_actors.protocol.events import StepFinished, StepStarted
from vllm_actors.protocol.messages import (
    ControlReply,
    EngineControl,
    Logprobs,
    Message,
    NewRequest,
    PromptLogprobs,
    StepPlan,
    StepResult,
)
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.outputs import Outputs


class Worker(Draw, KvRejoining, Membership, DeferredSteps, OverlapSteps):
    name = "worker"

    def __init__(
        self, runner: Runner, sampler: TokenSampler, clock: Callable[[], float], defer: bool = False,
        grammars: GrammarSource | None = None, await_reset: bool = False, tp_graph_draws: bool = True,
        host_tier: HostTierCopies | None = None, stage: Stage | None = None, ranks: Ranks | None = None,
        drafter: Proposer | None = None, rejoiner: Rejoiner | None = None, timer: StepTimer | None = None,
        spec_overlap: bool = True,
    ) -> None:
        """``clock``: seconds (the shell passes ``time.perf_counter``), to time each step.
        ``defer``: launch a step before reading the previous one back, where the runner can take
        input ids from the device (``supports_deferred_inputs``). ``grammars``: structured outputs
        (without, a constrained request is rejected). ``await_reset``: drop every plan until a
        reset plan (a restarted tensor-parallel rank: a plan queued for its predecessor may reach
        it and not its peers, and a step run by one rank alone would hang the group).
        ``tp_graph_draws``: under tensor parallelism, every rank draws a sampling decode graph's
        tokens itself (False: rank 0 draws every step and broadcasts). ``host_tier``: the host KV
        tier's memory, where the KV-cache manager has one (the plan's block copies go through it).
        ``stage``: its pipeline stage; a stage before the last runs its layers and hands its output
        on (``runner.execute``), samples nothing and answers nothing. ``ranks``: who samples and
        who takes the broadcast ids (default: the runner's TP group; under KV parallelism every
        rank of the replica). ``drafter``: a draft model's or EAGLE-3 head's proposals (speculative decoding).
        ``rejoiner``: a KV-parallel rank that outlives a dead peer and rejoins (``kv_rejoin``; None: a
        failed collective propagates). ``timer``: GPU time of the steps that sample nothing, on rank 0
        (``build_worker`` gives a CUDA runner's one over CUDA events; default: none, as on a CPU).
        ``spec_overlap``: an n-gram verification is read back after the next step is launched, where
        the runner can move that step's rows on the device (``spec_overlap``; ``VLLM_ACTORS_SPEC_OVERLAP``)."""
        self.rejoiner = rejoiner
        self._lost_peer = False  # a collective failed: plans are dropped until the rejoin plan
        self._rejoin_step = -1  # the last rejoin plan's step id: its result answers as a reset's
        self.drafter = drafter
        self.host_tier = host_tier
        self._fences = CopyFences()
        self.graph_draws_under_tp = tp_graph_draws
        self.grammars = grammars
        self._await_reset = await_reset
        self.defer = defer and runner.supports_deferred_inputs
        self.spec_overlap = spec_overlap and self.defer and getattr(runner, "supports_overlap_rows", False)
        self.num_overlapped_steps = 0  # steps launched before the verification in flight was read back
        self._pending: PendingStep | None = None
        self._last_read_back = float("-inf")  # the clock at the last step's read-back (interval_seconds)
        self._copies = HostCopies()
        self.runner = runner
        self.tp: Ranks = ranks or runner.tp
        self.stage: Stage = stage or OnlyStage()
        self.answers = self.tp.rank == 0 and self.stage.is_last  # the rank that answers the scheduler
        self.sampler = sampler
        self.clock = clock
        self.requests: dict[str, WorkerRequest] = {}
        width = runner.max_blocks_per_seq
        self.tables = BlockTableArray(width) if width else None
        self._min_step_id = 0  # step id of the last reset plan: older plans are stale
        self.borrowing: BorrowingHooks | None = None  # borrowed KV across replicas (runner/kv_borrowing.py)
        # only rank 0 reports: the other ranks time nothing (nor look for what completed)
        self.timings = TimingReports(timer if self.tp.rank == 0 else None, self.stage, self.answers)

    @property
    def timer(self) -> StepTimer:
        return self.timings.timer

    def handle(self, message: Message) -> Outputs:
        if isinstance(message, EngineControl):
            return self.control(message)
        if not isinstance(message, StepPlan):
            raise TypeError(f"the worker does not take {type(message).__name__}")
        rejoin = message.kv_rejoin
        if message.step_id < self._min_step_id and not message.reset and rejoin is None:
            return Outputs()  # planned before the pipeline reset: its blocks may be someone else's now
        if rejoin is None and (self._lost_peer or (self._await_reset and not message.reset)):
            return Outputs()
        self._await_reset = False
        try:
            outputs = Outputs()
            if rejoin is not None:
                self._pending = None  # a survivor's launched step went with its peer
                self._min_step_id = self._rejoin_step = message.step_id
                outputs = self._rejoin(rejoin, message.step_id)
            return outputs.extend(self._run(message))
        except RuntimeError as error:  # a collective with a peer that died (else re-raised)
            self._peer_lost(error)
            self._pending = None
            return Outputs()

    def _run(self, message: StepPlan) -> Outputs:
        self._take_input_tokens(message)
        self.validate(message)
        started = step_started(message)
        drafted: dict[str, int] = {}
        pending = self._pending
        early = Outputs()  # a verification read back before this plan (its rows could not be moved)
        waited = False
        if pending is not None and pending.verifying is not None:
            running = not pending.ready()
            # still running: this plan runs as a plain step launched before its read-back (spec_overlap)
            over = self._launch_over_verification(message, started, pending) if running else None
            if over is not None:
                return over
            early, waited = self.flush(), running  # done, or this plan needs its tokens: read back first
        elif self.defer and pending is not None and isinstance(self.drafter, NgramProposer):
            # lookups that cannot find anything whatever the pending tokens: a plain step, overlapped
            message, drafted = self.drafter.without_hopeless(message, self.requests) or (message, drafted)
        if self.defer and self._deferrable(message):
            # A step already done is read back first: its result goes out at once, and the GPU
            # is idle anyway. One still running is read back after this plan is launched.
            outputs = early.extend(self.flush() if self.pending_ready() else Outputs())
            launched = self._launch(message, started, read_now=False, num_drafted=drafted)
            launched.drained = waited
            outputs += self.flush()
            self._pending = launched
            return outputs
        drained = waited or (self.defer and self._pending is not None)
        outputs = early.extend(self.flush())
        later = self._verifies_later(message)  # its verification read back after the next launch
        launched = self._launch(message, started, read_now=not later, may_defer=self.defer)
        launched.drained = drained
        if launched.chosen is not None:  # a deferred step: no drafts found, or a verification read back later
            self._pending = launched
            return outputs
        return outputs.extend(self._outputs(launched, self._read_back(launched)))

    def control(self, control: EngineControl) -> Outputs:
        """Carry out an engine command after the pending step; rank 0 answers the scheduler."""
        outputs = self.flush()
        if self.borrowing is not None and control.action in ("sleep", "wake_up"):
            # a lender's share holds the caches, and a woken model would lose the borrowing backend
            error: str | None = f"{control.action}: not supported with kv_borrowing yet"
        else:
            if control.action == "sleep" and control.level > 0:
                self.reset()  # the KV cache is discarded: the scheduler restarts the pipeline after the wake
            error = carry_out(self.runner, control)
        if self.answers:
            outputs.send(SCHEDULER, ControlReply(control_id=control.control_id, success=error is None, error=error))
        return outputs

    def _outputs(self, pending: PendingStep, result: StepResult) -> Outputs:
        outputs = Outputs()
        if self.tp.rank != 0:
            return outputs  # rank 0 of the last stage answers for the group
        started, spec = pending.started, pending.spec
        finished = StepFinished(
            step_id=result.step_id,
            num_seqs=started.num_seqs,
            num_tokens=result.num_batched_tokens,
            num_sampled=len(result.req_ids),
            execute_ms=pending.host_seconds * 1e3,  # the host's, also where the GPU's comes later (STEP_TIMED)
            stage=None if self.stage.is_last else self.stage.stage,
            drained=pending.drained,
            overlapped=pending.overlapped,
        )
        if spec is not None:
            finished.num_drafts, finished.num_draft_tokens = spec.num_drafts, spec.num_draft_tokens
            finished.num_accepted_tokens, finished.accepted_per_pos = spec.num_accepted_tokens, spec.accepted_per_pos
        outputs.emit(started, finished)  # an earlier stage: its part of the step, one track per stage in the trace
        self.timings.report(outputs, result)  # the timed steps complete now; the result takes the last stage's
        if self.answers:
            outputs.send(SCHEDULER, result)
        return outputs

    # ------------------------------------------------------------------ one step
    def execute(self, plan: StepPlan) -> StepResult:
        """Run a step and read it back at once (with the logprobs and prompt logprobs it asks for)."""
        return self._read_back(self._launch(plan, step_started(plan), read_now=True))

    def _launch(self, plan: StepPlan, started: StepStarted, read_now: bool, may_defer: bool = False,
                num_drafted: dict[str, int] | None = None) -> PendingStep:
        """The step's body: run it and draw its tokens. ``read_now``: the step is read back at once
        (the sampler returns the ids on the host, with logprobs); otherwise they stay on the device,
        and input ids that the pending step sampled are taken from its sampled ids there.
        ``may_defer``: a drafting plan left without drafts (n-gram) becomes a deferred step.
        ``num_drafted``: the drafted counts of placeholders already dropped (``StepResult.num_drafted``)."""
        started_at = self.clock()
        pending = None if read_now else self._pending
        self._apply_membership(plan)
        planned = plan
        plan, num_drafted = self._with_drafts(plan, dict(num_drafted or {}))
        if self.drafter is not None and planned.draft_token_ids and may_defer and self._pending is None \
                and not plan.draft_token_ids and self._deferrable(plan):
            read_now = False
        if self.host_tier is not None:
            if plan.offload_copies or plan.restore_copies:
                fence = self._fences.fence(plan.offload_copies, plan.restore_copies)
                self.host_tier.copy(plan.offload_copies, plan.restore_copies, fence)
            self.host_tier.settle(reuse=plan.reset or bool(plan.evicted_hashes))
        step = build_batch(plan, self.requests, self.tables, pending)
        if pending is not None and pending.verifying is not None:  # rows moved by its accepted counts
            step.batch.overlap = overlap_rows(step.batch, pending)
        if self.borrowing is not None:  # a step with a borrowing request runs eagerly (no CUDA graph)
            step.batch.eager = self.borrowing.begin_step(plan.req_ids)
        batch, samplers = step.batch, step.samplers
        if not batch.token_ids:
            return PendingStep(plan.step_id, started_at=None if read_now else started_at, started=started, samplers=[],
                               chosen=None, host=[], done=None, num_batched_tokens=0, reset=plan.reset,
                               num_drafted=num_drafted)
        # timed on the GPU where its read-back will not wait for the device (``timing_reports``)
        timed = self.timings.begin(plan.step_id, samples=bool(samplers))
        if not self.stage.is_last:  # its output goes on to the next stage, which samples
            self.runner.execute(batch)
            self.timings.end()
            self._step_launched(plan)
            return PendingStep(plan.step_id, started_at, started, samplers=[], chosen=None, host=[], done=None,
                               num_batched_tokens=len(batch.token_ids), reset=plan.reset, gpu_timed=timed)
        row_owners = samplers
        if step.drafts:  # speculative decoding: a row per verified position
            rows, row_owners = expand_rows(samplers, step.drafts)
        else:
            rows = [request.sampling_row() for request in samplers]
        # a verification step, read back at once, draws in the graph too where no row needs the host
        sampling = self._graph_sampling(batch, rows) if not read_now or self._verifies_in_graph(step) else None
        logprobs: list[Logprobs | None] = []
        prompt_logprobs: list[PromptLogprobs] = []
        chosen: torch.Tensor | list[int]
        if sampling is not None:  # one replay runs the step and draws its tokens
            chosen = self.runner.execute_sampled(batch, sampling)
        else:
            logits = self.runner.execute(batch)
            if self.tp.rank == 0:  # the rank that draws
                prompt_logprobs = [prompt_logprobs_of(span, logits) for span in step.spans]
                if samplers and step.sample_rows != list(range(logits.shape[0])):
                    # not when every row samples (decode): no copy of batch x vocab
                    logits = logits.index_select(0, upload(step.sample_rows, logits.device))
                self._mask(logits, row_owners, pending, rows)
            # a verification read back at once counts the tokens it keeps (_count_kept), not its draws
            chosen, logprobs = self._draw(logits, rows, read_now, count=not (step.drafts and read_now))
        self.timings.end()
        spec = verifying = accepted = None
        if step.drafts and not read_now and isinstance(chosen, torch.Tensor):
            # verified at the read-back; the accepted counts on the device now, for the next step's rows
            verifying, accepted = step.drafts, accepted_counts(chosen, step.drafts)
        elif step.drafts:  # read at once: the tokens each request keeps
            drawn = chosen if isinstance(chosen, list) else chosen.tolist()  # ranks above 0: rank 0's ids
            samplers, chosen, logprobs, spec = verify(samplers, step.drafts, drawn, logprobs)
            self._count_kept(samplers, chosen)
        self._step_launched(plan)
        for request in samplers:
            request.num_output_tokens += 1
            request.num_pending += 1  # 2 until the previous step (launched before) is read back
        if verifying is not None:  # counted as if every draft were accepted until the read-back
            self._count_as_accepted(samplers, verifying)
        elif read_now or isinstance(chosen, list):  # the host reads the ids now
            return PendingStep(plan.step_id, started_at, started, samplers, chosen=None, host=chosen, done=None,
                               num_batched_tokens=len(batch.token_ids), reset=plan.reset, logprobs=logprobs,
                               prompt_logprobs=prompt_logprobs, spec=spec, num_drafted=num_drafted, gpu_timed=timed)
        assert isinstance(chosen, torch.Tensor)
        host, done = self._copies.start(chosen)  # on its way to the host while the next step launches
        first = first_rows(verifying) if verifying is not None else range(len(samplers))  # each sampler's first draw
        overlap = batch.overlap
        return PendingStep(plan.step_id, started_at, started, samplers, chosen=chosen, host=host, done=done,
                           num_batched_tokens=len(batch.token_ids),
                           row_of={request.request_id: row for request, row in zip(samplers, first, strict=True)},
                           num_drafted=num_drafted, gpu_timed=timed, verifying=verifying, accepted=accepted,
                           overlapped=len(overlap.rows) if overlap is not None else 0)

    def _step_launched(self, plan: StepPlan) -> None:
        """The host tier's copies may have to wait for this step; its write-through follows it."""
        if self.host_tier is not None:
            index = self._fences.launched()
            self.host_tier.step_launched(index)
            self.host_tier.write_through(plan.write_through_copies, index)

    def _read_back(self, pending: PendingStep) -> StepResult:
        """The launched step's tokens appended to their requests, and its result."""
        self._feed_grammars(pending)
        token_ids = pending.token_ids()
        if pending.verifying is not None:  # a verification read back after the next launch: the tokens kept
            token_ids = self._settle_verification(pending, token_ids)
        for request, token_id in zip(pending.samplers, token_ids, strict=True):
            request.token_ids.append(token_id)
            request.num_pending -= 1
        now, last_done = self.clock(), self._last_read_back
        self._last_read_back = now
        pending.host_seconds = 0.0 if pending.started_at is None else now - pending.started_at
        return StepResult(
            step_id=pending.step_id,
            reset=pending.reset or pending.step_id == self._rejoin_step,
            req_ids=[request.request_id for request in pending.samplers],
            token_ids=token_ids,
            logprobs=pending.logprobs,
            prompt_logprobs=pending.prompt_logprobs,
            num_batched_tokens=pending.num_batched_tokens,
            execute_seconds=0.0 if pending.gpu_timed else pending.host_seconds,  # 0: its time comes later
            interval_seconds=0.0 if pending.started_at is None else now - max(pending.started_at, last_done),
            num_drafted=pending.num_drafted,
            overlapped_ids=pending.overlapped_ids,
        )

    # ------------------------------------------------------------------ membership
    def _admit(self, new: NewRequest) -> None:
        self._drop(new.request_id)
        token_ids = new.token_list()
        grammar = None
        samples = self.stage.is_last  # a pipeline stage before the last draws nothing: no grammar, no penalties
        if new.params.structured_outputs is not None and self.grammars is not None and samples:
            # A resumed request (preempted, or resubmitted) replays its outputs into a fresh matcher.
            grammar = self.grammars.start(new.params.structured_outputs, token_ids[new.num_prompt_tokens:])
        penalty_slot = -1
        if new.params.has_penalties and samples:
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
            lora_request=new.lora_request,
        )
