"""One planning pass of the scheduler (``Scheduler`` mixes this in): the running requests served
first, in the policy's order, from the step's token budget (preempting from the back when blocks
run short); then the waiting requests admitted while slots, budget and blocks allow; the step's
plan built from both. Also the scheduler's counters (``SchedulerStats``)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm_actors.actors.scheduler.admission import adapter_fits, admit, running_adapters
from vllm_actors.actors.scheduler.kv_rejoin import without_departed
from vllm_actors.actors.scheduler.plan import StepBuilder
from vllm_actors.actors.scheduler.prefill_sizing import PrefillSizer, is_decoding, yielding
from vllm_actors.actors.scheduler.request import ScheduledRequest, Status
from vllm_actors.actors.scheduler.stages import carry_input_tokens, decode_share, waits_for_its_token
from vllm_actors.protocol.events import Resumed, Scheduled
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.outputs import Outputs

if TYPE_CHECKING:
    from vllm_actors.actors.scheduler.block_ledger import BlockLedger
    from vllm_actors.actors.scheduler.controls import SleepState
    from vllm_actors.actors.scheduler.cost_model import CostModel
    from vllm_actors.actors.scheduler.kv_loans import LoanDesk
    from vllm_actors.actors.scheduler.pipeline import StepPipeline
    from vllm_actors.actors.scheduler.policies.base import QueuePolicy
    from vllm_actors.actors.scheduler.speculation import Speculator
    from vllm_actors.protocol.config import SchedulerConfig


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prefill_chunks: int = 0  # prefill work split over several steps
    num_resets: int = 0  # pipeline resets (RecoverPipeline)
    num_stale_results: int = 0  # step results of plans sent before a reset, ignored


class PlanningPass:
    """The planning half of ``Scheduler``."""

    if TYPE_CHECKING:  # provided by Scheduler
        config: SchedulerConfig
        cost_model: CostModel
        waiting: deque[ScheduledRequest]
        running: list[ScheduledRequest]
        policy: QueuePolicy
        pipeline: StepPipeline
        ledger: BlockLedger
        stats: SchedulerStats
        sleep: SleepState
        spec: Speculator | None
        loans: LoanDesk

        def _preempt(self, request: ScheduledRequest, out: Outputs) -> None: ...

    def _maybe_schedule(self, out: Outputs) -> StepPlan | None:
        if self.pipeline.is_full or self.sleep.paused:
            return None
        if not (self.waiting or self.running or self.pipeline.has_news or self.ledger.has_evicted
                or self.loans.has_news):
            return None
        plan, sampling_ids = self._schedule(out)
        rejoin = self.pipeline.take_rejoin()  # applied before the step, on every rank
        plan.kv_rejoin = without_departed(rejoin, plan.finished_ids) if rejoin is not None else None
        if not (plan.req_ids or plan.finished_ids or plan.reset or plan.evicted_hashes or plan.host_dropped_hashes
                or plan.restored_hashes or plan.loans or plan.returned_loans or plan.kv_rejoin):
            return None  # everything waits for tokens in flight
        self.pipeline.sent(plan, sampling_ids)
        self.stats.num_steps += 1
        return plan

    def _schedule(self, out: Outputs) -> tuple[StepPlan, list[str]]:
        """One planning pass: the step's plan and the requests it samples a token for."""
        rejoining = self.pipeline.rejoin_pending
        if rejoining:  # idle cached blocks may have lost the dead rank's share (those let go since too)
            self.ledger.evict_idle()
        step = StepBuilder(self.pipeline.next_step_id, self.config.max_num_batched_tokens, self.ledger)
        self.policy.begin_pass(self.stats.num_steps, len(self.running))
        self.policy.order_running(self.running)  # most urgent first: the last one is preempted
        if self.spec is not None:
            self.spec.begin_pass(self.running)
        if len(self.running) >= self.config.max_num_seqs and self.waiting and self.sleep.admitting and not rejoining:
            self.waiting = self.policy.order_waiting(self.waiting, self.ledger)
            for victim in self.policy.slot_victims(self.waiting, self.running, self.config.max_num_seqs, step.budget):
                self._preempt(victim, out)  # a more urgent waiting request takes its slot below
        sizer = PrefillSizer(self.config, self.cost_model, self.running)
        # At a chunk boundary a prefill yields to the waiting requests that outrank it (or, a long one,
        # to short prompts): they are admitted first, it takes what the step has left.
        # (not in a rejoin's plan: the ranks re-seed the running requests from its snapshot first)
        yields = self.sleep.admitting and not rejoining
        deferred = yielding(self.policy, self.waiting, self.running, sizer.short_first) if yields else set()
        preempted = self._schedule_running(step, out, sizer, deferred, rejoining=rejoining)
        self.loans.grant(self.ledger)  # other replicas' loans: before any new request of ours
        if not preempted and self.sleep.admitting and self.loans.admits:
            self._admit_waiting(step, out, sizer)
        if deferred:
            self._schedule_running(step, out, sizer, deferred, deferred_turn=True)
        departed = self.pipeline.take_departed()
        trimmed = self.spec.take_trims(departed) if self.spec is not None else None
        plan, sampling_ids, chunks, num_partial = step.build(self.pipeline.reset_pending, departed, trimmed)
        self.loans.fill(plan)
        if self.config.pipeline_parallel_size > 1:
            carry_input_tokens(plan, (request for request, _ in step.scheduled))
        out.emit(*chunks)
        self.stats.num_prefill_chunks += num_partial
        return plan, sampling_ids

    def _schedule_running(self, step: StepBuilder, out: Outputs, sizer: PrefillSizer,
                          deferred: set[str], deferred_turn: bool = False, rejoining: bool = False) -> bool:
        """Give the running requests, in order, what they still need of the budget (prefills as
        ``sizer`` sizes them; the ``deferred`` ones only on their turn), preempting from the back
        when blocks run short (never in a KV-parallel rejoin's pass: ``rejoining``). True when
        someone was preempted (nobody is admitted then)."""
        preempted = False
        index = 0
        # pipeline stages: one decode micro-batch per stage, each its share of the decodes (stages.py; the
        # deferred turn has prefills only)
        num_stages = self.config.pipeline_parallel_size
        decodes_left = len(self.running) if num_stages == 1 else \
            0 if self.pipeline.num_decoding >= num_stages else decode_share(self.running, num_stages)
        # a quiet speculating pass drafts nothing for anyone: no question per request (O(1), not O(batch))
        speculates = self.spec is not None and not self.spec.quiet
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, step.budget)
            if (num_new <= 0 or not request.wants_more(self.config.max_model_len)
                    or (request.request_id in deferred) != deferred_turn
                    or waits_for_its_token(request, self.config.pipeline_parallel_size)):
                index += 1
                continue
            prefill = not is_decoding(request)
            if not prefill and decodes_left <= 0:
                index += 1  # its share of this micro-batch is taken: the next step takes it
                continue
            if prefill:
                num_new = sizer.chunk(request, num_new) if sizer.admits(request) else 0
                if not num_new:
                    index += 1
                    continue
            drafts = self._drafts(request, num_new, step.budget) if speculates else []
            if drafts is None:  # it speculates: planned again once its step in flight is back
                index += 1
                continue
            num_new += len(drafts)
            needed = self.ledger.blocks_missing(request.request_id, request.num_computed_tokens + num_new)
            if needed > self.ledger.num_available and (rejoining or (deferred_turn and step.scheduled)):
                # a yielding prefill preempts nobody taken into this step already (the requests behind
                # it may be this pass's admissions): it goes on next step; with the step empty it
                # preempts as any prefill (else nothing would move). A rejoin's pass preempts nobody:
                # a victim's blocks would be cached with the dead rank's share lost (its plan goes
                # out anyway, the next pass preempts as usual)
                index += 1
                continue
            while needed > self.ledger.num_available:
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                break  # it preempted itself: everything after it is gone too
            if prefill:
                sizer.took(request, num_new)
            step.take(request, num_new, needed, drafts=drafts)
            decodes_left -= not prefill
            index += 1
        return preempted

    def _drafts(self, request: ScheduledRequest, num_new: int, budget: int) -> list[int] | None:
        """Speculative decoding: a decoding request's drafted tokens ([]: none; None: it waits)."""
        if self.spec is None or num_new != 1 or request.num_computed_tokens + 1 < request.num_tokens:
            return []
        return self.spec.drafts(request, budget, self.config.max_model_len)

    def _admit_waiting(self, step: StepBuilder, out: Outputs, sizer: PrefillSizer) -> None:
        """Admit waiting requests, in the policy's order, while slots, budget and blocks allow (a
        prefill the sizer holds back this step is passed over, the ones behind it go on)."""
        self.waiting = self.policy.order_waiting(self.waiting, self.ledger)
        passed: list[ScheduledRequest] = []
        adapters = running_adapters(self.running)
        while self.waiting and step.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted while a step was in flight: resume once its token is here
            if not sizer.admits(request):
                passed.append(self.waiting.popleft())
                continue
            if not adapter_fits(request, adapters, self.config.max_loras):
                # one adapter more than a step may use: as vLLM, the requests behind it may go first
                passed.append(self.waiting.popleft())
                continue
            num_query, num_hit, hit_hash = admit(request, self.ledger)
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, step.budget)
            if remaining > 1:
                num_new = sizer.chunk(request, num_new)
            needed = self.ledger.blocks_missing(request.request_id, request.num_computed_tokens + num_new)
            unchunked = remaining > step.budget and not self.config.enable_chunked_prefill
            if unchunked or not num_new or needed > self.ledger.num_available:
                self.ledger.release(request.request_id)  # not now: give the hit back
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            if request.lora_int_id:
                adapters.add(request.lora_int_id)
            if not request.num_preemptions and not request.output_token_ids:
                request.num_cached_prompt_tokens = min(num_hit, len(request.prompt_token_ids))
            admitted = Resumed if request.num_preemptions else Scheduled
            out.emit(admitted(request_id=request.request_id, step_id=step.step_id, num_query_tokens=num_query,
                              num_cached_tokens=num_hit))
            if remaining > 1:
                sizer.took(request, num_new)
            step.take(request, num_new, needed, new=request.new_request(num_hit, hit_hash))
        self.waiting.extendleft(reversed(passed))  # every exit above is a break: back at the front, in order
