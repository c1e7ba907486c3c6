"""The scheduler: waiting and running queues, token budget, chunked prefill, preemption, stops.

A pure state machine. ``handle`` takes a message (a new request, an abort, a worker's step result,
a pipeline reset) and returns its ``Outputs``: ``RequestUpdates`` for the frontend, as many
``StepPlan``s for the KV-cache manager as keep ``max_steps_in_flight`` steps in flight (planning
step N+1 while step N runs), and the events.

A planning pass serves the running requests first, in the policy's order, each taking what it
still needs of the token budget (one token when decoding, the rest of the prompt - or a chunk of
it - when prefilling); then admits waiting requests, in the policy's order, while the budget,
``max_num_seqs`` and free KV blocks allow. When a running request needs a block and none is
available, the last running request in the policy's order is preempted (its blocks freed; it is
recomputed from its prompt and outputs when it comes back).

Prefix caching (``block_ledger``): on admission a request takes the longest run of cached full
blocks matching its tokens and computes only the rest; its blocks are cached as they fill; idle
cached blocks count as available and are evicted, least recently used first, before anyone is
preempted.

The scheduler's other modules, one concern each:

- ``admission``: an arriving request's checks; admission with its prefix-cache lookup;
- ``policies/``: the order of both queues, one module per ``scheduling_policy`` (fcfs, lpm,
  priority, edf, lrs), behind one interface (``policies/base.py``);
- ``planning_pass``: one planning pass (the running requests served, the waiting ones admitted);
- ``plan``: a planning pass's decisions turned into a ``StepPlan``;
- ``pipeline``: the steps in flight, results matched to plans, the pipeline reset;
- ``stages``: pipeline parallelism (micro-batches, tokens carried to the stages before the last);
- ``results``: a step's tokens, stops and updates;
- ``recovery``: what a restart elsewhere in the group does to the requests; resubmissions;
- ``cost_model``, ``deadlines``: the step cost model; remaining work and admission control;
  ``late_timings``: the cost model taught by steps whose GPU time comes in a later result;
- ``request``: the per-request state; ``block_ledger``, ``prefix_cache``: the KV pool as the
  scheduler counts it;
- ``owners``: which client connection owns which request (used by the scheduler's shell);
- ``controls``: engine commands (sleep, wake-up, prefix-cache reset, profiler): checks, sleep state;
- ``speculation``, ``ngram``, ``spec_policy``: speculative decoding (drafts, rollback, drafts per step).
- ``kv_loans``: blocks lent to other replicas' requests (borrowed KV capacity in a replica set).
"""

from __future__ import annotations

from collections import deque

import msgspec

from vllm_actors.actors.scheduler.admission import admission_error, identity_error, pool_error
from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.controls import SleepState, control_error
from vllm_actors.actors.scheduler.cost_model import CostModel, OnlineCostModel
from vllm_actors.actors.scheduler.deadlines import step_features, unmeetable_error
from vllm_actors.actors.scheduler.kv_loans import LoanDesk
from vllm_actors.actors.scheduler.kv_rejoin import rejoin_of, roll_back
from vllm_actors.actors.scheduler.late_timings import LateTimings
from vllm_actors.actors.scheduler.owners import refused_request
from vllm_actors.actors.scheduler.pipeline import StepPipeline
from vllm_actors.actors.scheduler.planning_pass import PlanningPass, SchedulerStats
from vllm_actors.actors.scheduler.policies import make_policy
from vllm_actors.actors.scheduler.prefill_sizing import note_chunk_times
from vllm_actors.actors.scheduler.recovery import catch_up, ended_by_its_outputs, start_over
from vllm_actors.actors.scheduler.request import ScheduledRequest, Status, packed_prompt
from vllm_actors.actors.scheduler.results import apply_result
from vllm_actors.actors.scheduler.speculation import Speculator
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import Aborted, PipelineReset, Preempted, Queued
from vllm_actors.protocol.kv_loans import BorrowKv, LendKv, ReturnKv
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    ControlReply,
    EngineControl,
    Message,
    RecoverPipeline,
    RequestUpdate,
    RequestUpdates,
    StepResult,
)
from vllm_actors.protocol.names import FRONTEND, KV_CACHE_MANAGER, is_worker
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.token_ids import token_id_array

MAX_ABORT_REASON = 64  # characters of a client's abort reason that reach the bus


class Scheduler(PlanningPass):
    name = "scheduler"

    def __init__(self, config: SchedulerConfig, first_step_id: int = 0, cost_model: CostModel | None = None) -> None:
        """``first_step_id``: a restarted scheduler numbers its steps above every id its
        predecessors used (the supervisor passes ``incarnation << 40``), so a dead scheduler's plan
        still in the pipeline can never pass for one of its own. ``cost_model``: the step cost
        model of the deadline policies and admission control (default: fitted online from the
        steps' measured times; tests inject a fixed one)."""
        self.config = config
        self.cost_model: CostModel = cost_model if cost_model is not None else OnlineCostModel()
        self.late_timings = LateTimings()  # steps timed on the GPU whose time comes in a later result
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: list[ScheduledRequest] = []
        self.requests: dict[str, ScheduledRequest] = {}
        self.policy = make_policy(config.scheduling_policy, self.cost_model)
        self.pipeline = StepPipeline(first_step_id, config.max_steps_in_flight)
        self.ledger = self._new_ledger()
        self.stats = SchedulerStats()
        self._num_arrivals = 0
        self.sleep = SleepState()
        self.spec = (Speculator(config.speculative, self.cost_model, config.block_size, config.max_steps_in_flight > 1)
                     if config.speculative is not None else None)
        self.loans = LoanDesk()  # blocks lent to other replicas' requests (a replica set's borrowing)

    @property
    def reset_pending(self) -> bool:
        """The next plan resets the pipeline (no reset plan sent since the last restart)."""
        return self.pipeline.reset_pending

    @property
    def departed(self) -> tuple[str, ...]:
        """Requests that left the worker since the last plan (the next plan's ``finished_ids``)."""
        return self.pipeline.departed

    # ------------------------------------------------------------------ messages
    def handle(self, message: Message) -> Outputs:
        out = Outputs()
        if isinstance(message, AddRequest):
            self._add(message, out)
        elif isinstance(message, AbortRequests):
            self._abort(message, out)
        elif isinstance(message, StepResult):
            self._on_step_result(message, out)
        elif isinstance(message, RecoverPipeline) and message.kv_rank >= 0:  # a KV-parallel rank restarted alone
            roll_back(self.pipeline.forget_in_flight(), self.requests)
            self.pipeline.rejoin(rejoin_of(message.kv_rank, message.rendezvous, self.running, self.ledger))
        elif isinstance(message, RecoverPipeline):  # a restarted worker leaves the host KV tier as it was
            self._recover(f"{message.actor}: {message.reason}", out, keep_host=is_worker(message.actor))
        elif isinstance(message, EngineControl):
            self._control(message, out)
        elif isinstance(message, (LendKv, ReturnKv)):
            self.loans.handle(message, self.ledger)
        elif isinstance(message, BorrowKv):  # the next AddRequest of this id runs on borrowed blocks
            self.loans.guests[message.request_id] = message.lenders
        elif isinstance(message, ControlReply):  # rank 0 carried a command out: its sender learns
            out.send(FRONTEND, msgspec.structs.replace(message, is_sleeping=self.sleep.is_sleeping))
        else:
            raise TypeError(f"the scheduler does not take {type(message).__name__}")
        # Fill the pipeline, not just one slot: with one plan per message a lone request's decode
        # would never get a second step in flight (each result releasing exactly one plan).
        while (plan := self._maybe_schedule(out)) is not None:
            out.send(KV_CACHE_MANAGER, plan)
        # The plans are on the device's critical path (a speculating request's GPU idles until its
        # next plan), the clients' updates are not: they go out last (a stable sort keeps each
        # destination's order).
        out.messages.sort(key=lambda sent: sent[0] == FRONTEND)
        return out

    # ------------------------------------------------------------------ requests
    def _add(self, message: AddRequest, out: Outputs) -> None:
        borrowed = self.loans.guests.pop(message.request_id, [])
        if message.resume and message.request_id in self.requests:
            out.messages.extend(catch_up(self.requests[message.request_id], message))
            return
        error = identity_error(message, self.requests)
        if error is None:
            error = admission_error(message, self.config) or (None if borrowed else pool_error(message, self.config))
            if error is None and self.config.reject_unmeetable:
                error = self._unmeetable_error(message)
            if error is not None:  # a well-formed id of no other request: its timeline says why
                out.emit(Aborted(request_id=message.request_id, reason="error"))
        if error is not None:  # answered to its sender only; nothing else changed
            out.send(FRONTEND, refused_request(message.request_id, error))
            return
        request = ScheduledRequest.arriving(message, self._num_arrivals, self.stats.num_steps)
        request.borrowed = borrowed
        self._num_arrivals += 1
        ended = ended_by_its_outputs(request, self.config.max_model_len)
        if ended is not None:  # a resubmission whose last token ended it: the client missed only that
            out.emit(ended[0])
            out.send(FRONTEND, ended[1])
            return
        self.requests[request.request_id] = request
        self.waiting.append(request)
        out.emit(Queued(request_id=request.request_id, num_waiting=len(self.waiting), priority=message.priority,
                        ttft_deadline=message.ttft_deadline, e2e_deadline=message.e2e_deadline,
                        lora_int_id=request.lora_int_id))

    def _unmeetable_error(self, message: AddRequest) -> str | None:
        """Admission control: its deadlines against the queue the policy puts ahead of it."""
        prompt = token_id_array(packed_prompt(message))
        arriving = ScheduledRequest(request_id=message.request_id, prompt_token_ids=prompt,
                                    params=message.params, eos_token_ids=message.eos_token_ids,
                                    priority=message.priority, ttft_deadline=message.ttft_deadline,
                                    e2e_deadline=message.e2e_deadline, arrival=self._num_arrivals)
        ahead = self.policy.queue_ahead(self.waiting, arriving) + self.running
        return unmeetable_error(message, ahead, len(self.running), self.cost_model,
                                self.config.max_num_batched_tokens, self.config.max_num_seqs)

    def _abort(self, message: AbortRequests, out: Outputs) -> None:
        for request_id in message.request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if message.reason != "stop":  # a stop string: the frontend published FINISHED
                out.emit(Aborted(request_id=request_id, reason=message.reason[:MAX_ABORT_REASON],
                                 num_output_tokens=len(request.output_token_ids)))
            self._finish(request_id)

    def _on_step_result(self, result: StepResult, out: Outputs) -> None:
        taken = self.pipeline.take_result(result)
        if taken is None:  # a plan's from before the last reset: its tokens do not count
            self.stats.num_stale_results += 1
            return
        plan, sampling_ids = taken
        if plan.req_ids:
            self.ledger.step_done(plan.step_id)
        sized = self.config.itl_target is not None  # what its chunks took caps a long prompt's next (prefill_sizing)
        features = step_features(plan, self.config.block_size) if self.spec is not None or sized else None  # once
        # the cost model learns the step, or later from its GPU time, and the earlier ones timed so
        self.late_timings.observe(self.cost_model, plan, result, self.config.block_size, features)
        if sized:
            note_chunk_times(plan, result, self.requests, self.cost_model, self.config.block_size, features)
        if self.spec is not None:
            self.spec.account(plan, result, self.requests, features)
        step = apply_result(self.requests, sampling_ids, result, self.config.max_model_len)
        for request_id in step.finished_ids:
            self._finish(request_id)
        if self.spec is not None:
            self.spec.trim(plan, self.requests, self.ledger)
        out.emit(*step.events)
        if step.updates:
            out.send(FRONTEND, RequestUpdates(step_id=result.step_id, updates=step.updates,
                                              step_finished_at=result.finished_at))
        if self.sleep.pending is not None and not self.running:  # a sleep of mode "wait": drained
            self._sleep(self.sleep.pending, out)

    # ------------------------------------------------------------------ engine commands
    def _control(self, control: EngineControl, out: Outputs) -> None:
        """An engine command (``controls``): answered here, or passed on to the workers, whose
        rank 0 answers through this scheduler."""
        error = control_error(control)
        if error is not None or control.action == "is_sleeping":
            out.send(FRONTEND, self.sleep.reply(control, error=error))
        elif control.action == "reset_prefix_cache":
            if control.reset_running_requests:
                while self.running:  # from the back: they return to the queue's front in order
                    self._preempt(self.running[-1], out)
            success = not self.running  # as vLLM: not while a request holds blocks
            if success:
                self.ledger.evict_idle()  # the next plan evicts them in the KV-cache manager too
            out.send(FRONTEND, self.sleep.reply(control, success=success))
        elif control.action == "sleep":
            if control.mode == "abort":
                self._abort_all(out)
            if control.mode == "wait" and self.running:
                self.sleep.pending = control  # nothing more is admitted; it sleeps once these are done
                return
            self._sleep(control, out)
        elif control.action == "wake_up":
            waking = self.sleep.wake(control.tags)
            out.emit(self.sleep.event())
            if waking:  # behind every plan sent before; its answer comes back from rank 0
                out.send(KV_CACHE_MANAGER, msgspec.structs.replace(control, tags=waking))
            else:
                out.send(FRONTEND, self.sleep.reply(control))
        else:  # the profiler runs in the workers
            out.send(KV_CACHE_MANAGER, control)

    def _sleep(self, control: EngineControl, out: Outputs) -> None:
        self.sleep.pending = None
        self.sleep.paused = True
        if control.level == 0 or self.sleep.asleep:  # scheduling paused only, or asleep already
            out.emit(self.sleep.event())
            out.send(FRONTEND, self.sleep.reply(control))
            return
        # The KV cache is discarded: the pipeline starts over once awake; what ran is recomputed.
        self._recover(f"sleep level {control.level}", out)
        self.sleep.asleep, self.sleep.level = {"weights", "kv_cache"}, control.level
        out.emit(self.sleep.event())
        out.send(KV_CACHE_MANAGER, control)

    def _abort_all(self, out: Outputs) -> None:
        """Every request ends with finish reason "abort" (a sleep of mode "abort", as vLLM)."""
        updates = []
        for request_id, request in list(self.requests.items()):
            out.emit(Aborted(request_id=request_id, reason="abort", num_output_tokens=len(request.output_token_ids)))
            updates.append(RequestUpdate(request_id=request_id, finish_reason="abort",
                                         num_prompt_tokens=len(request.prompt_token_ids)))
            self._finish(request_id)
        if updates:
            out.send(FRONTEND, RequestUpdates(step_id=-1, updates=updates))

    def _recover(self, reason: str, out: Outputs, keep_host: bool = False) -> None:
        """The KV-cache manager or a worker was restarted: what the pipeline held is gone (but for
        the host KV tier, after a worker's restart: ``keep_host``)."""
        running, self.running = self.running, []
        out.emit(*start_over(running, self.requests.values(), self.pipeline.next_step_id))
        self.waiting.extendleft(reversed(running))  # at the front, in batch order
        self.stats.num_preemptions += len(running)
        old, self.ledger = self.ledger, self._new_ledger()
        if keep_host:
            self.ledger.resume_host(old)
        self.pipeline.reset()
        self.late_timings.clear()
        self.loans.reset()
        if self.spec is not None:
            self.spec.take_trims([])  # the new ledger and pipeline start from nothing
        self.stats.num_resets += 1
        out.emit(PipelineReset(reason=reason, num_preempted=len(running)))

    def _new_ledger(self) -> BlockLedger:
        return BlockLedger(self.config.num_blocks, self.config.block_size, self.config.enable_prefix_caching,
                           self.config.num_host_blocks, self.config.host_write_through_tokens,
                           self.pipeline.next_step_id)

    def _finish(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        if request.status is Status.WAITING:
            self.waiting.remove(request)
        elif request.status is Status.RUNNING:
            self.running.remove(request)
        self._release(request)
        request.status = Status.FINISHED
        if self.spec is not None:
            self.spec.forget(request)

    def _release(self, request: ScheduledRequest) -> None:
        self.ledger.release(request.request_id)
        if request.in_worker:
            self.pipeline.depart(request.request_id)
            request.in_worker = False

    def _preempt(self, request: ScheduledRequest, out: Outputs) -> None:
        out.emit(Preempted(request_id=request.request_id, step_id=self.pipeline.next_step_id,
                           num_computed_tokens=request.num_computed_tokens))
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        request.queued_at_step = self.stats.num_steps
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
