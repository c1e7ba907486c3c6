"""The scheduler: waiting and running queues, token budget, chunked prefill, preemption, stops.

A pure state machine. ``handle`` takes a message (a new request, an abort, a worker's step result)
and returns the messages to send: at most one ``StepPlan`` per step to the KV-cache manager and one
``RequestUpdates`` per step to the frontend. One step is in flight at a time.

Policy (FCFS, like vLLM V1): running requests first, in arrival order, each taking what it still
needs (one token when decoding, the rest of the prompt - or a chunk of it - when prefilling); then
waiting requests while the token budget, ``max_num_seqs`` and free KV blocks allow. When a running
request needs a block and none is available, the most recently arrived running request is
preempted (its blocks freed; it is recomputed from its prompt and outputs when it comes back).

Prefix caching (``block_ledger``): on admission a request takes the longest run of cached full
blocks matching its tokens and computes only the rest; its blocks are cached as they fill (at
planning time, so a request admitted later in the same pass already hits them); idle cached blocks
count as available and are evicted, least recently used first, before anyone is preempted.

``queue_policy`` holds who gets in: admission checks and admission with its cache lookup;
``policies`` the order of both queues under ``scheduling_policy`` (fcfs, lpm, priority, edf, lrs:
running requests are served in that order and the last one is preempted); ``cost_model`` the step
cost model and ``deadlines`` admission control (``reject_unmeetable``); ``results`` a step's
result (tokens, stops); ``request`` the per-request state.

``recovery`` holds what a restart elsewhere in the group does to the scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.cost_model import CostModel, OnlineCostModel
from vllm_actors.actors.scheduler.deadlines import unmeetable_error
from vllm_actors.actors.scheduler.policies import LeastRemainingSlack, make_policy, queue_ahead, slot_victims
from vllm_actors.actors.scheduler.queue_policy import (
    admission_error,
    admit,
    identity_error,
)
from vllm_actors.actors.scheduler.recovery import catch_up, reset_pipeline
from vllm_actors.actors.scheduler.request import ScheduledRequest, Status, check_stop
from vllm_actors.actors.scheduler.results import on_step_result
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import (
    Aborted,
    Finished,
    Preempted,
    PrefillChunk,
    Queued,
    Resumed,
    Scheduled,
)
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    Message,
    NewRequest,
    RecoverPipeline,
    RequestUpdate,
    RequestUpdates,
    StepPlan,
    StepResult,
    pack_token_ids,
)
from vllm_actors.protocol.names import BUS, FRONTEND, KV_CACHE_MANAGER

MAX_ABORT_REASON = 64  # characters of a client's abort reason that reach the bus


@dataclass
class SchedulerStats:
    num_steps: int = 0
    num_preemptions: int = 0
    num_prefill_chunks: int = 0  # prefill work split over several steps
    num_resets: int = 0  # pipeline resets (RecoverPipeline)
    num_stale_results: int = 0  # step results of plans sent before a reset, ignored


class Scheduler:
    name = "scheduler"

    def __init__(self, config: SchedulerConfig, first_step_id: int = 0, cost_model: CostModel | None = None) -> None:
        """``first_step_id``: a restarted scheduler numbers its steps above every id its
        predecessors used (the supervisor passes ``incarnation << 40``), so a dead scheduler's plan
        still in the pipeline can never pass for one of its own. ``cost_model``: the step cost
        model of the deadline policies and admission control (default: fitted online from the
        steps' measured times; tests inject a fixed one)."""
        self.config = config
        self.cost_model: CostModel = cost_model if cost_model is not None else OnlineCostModel()
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: list[ScheduledRequest] = []
        self.requests: dict[str, ScheduledRequest] = {}
        self.policy = make_policy(config.scheduling_policy, self.cost_model)
        self._num_arrivals = 0
        self.ledger = BlockLedger(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self._departed: list[str] = []  # left the worker since the last plan
        self._events: list[Any] = []  # events of the message being handled
        # Plans sent whose results are not back yet (oldest first), with the ids each one samples.
        self._in_flight: deque[tuple[StepPlan, list[str]]] = deque()
        self._next_step_id = first_step_id
        self.stats = SchedulerStats()
        # Recovery: the next plan resets the pipeline (a new scheduler's first one does); once
        # sent, its step id until its result is back; results of step ids below are stale.
        self._reset_pending = True
        self._reset_step: int | None = None
        self._min_step_id = first_step_id

    # ------------------------------------------------------------------ messages
    def handle(self, message: Message) -> list[tuple[str, Any]]:
        """Returns the messages to send, then this handling's events (destination ``BUS``)."""
        out: list[tuple[str, Any]] = []
        self._events = []
        if isinstance(message, AddRequest):
            out.extend(self._add(message))
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                request = self.requests.get(request_id)
                if request is None:
                    continue
                if message.reason != "stop":  # a stop string: the frontend published FINISHED
                    self._events.append(
                        Aborted(request_id=request_id, reason=message.reason[:MAX_ABORT_REASON],
                                num_output_tokens=len(request.output_token_ids))
                    )
                self._finish(request_id)
        elif isinstance(message, StepResult):
            out.extend(on_step_result(self, message))
        elif isinstance(message, RecoverPipeline):
            reset_pipeline(self, f"{message.actor}: {message.reason}")
        else:
            raise TypeError(f"the scheduler does not take {type(message).__name__}")
        # Fill the pipeline, not just one slot: with one plan per message a lone request's
        # decode never got a second step in flight (each result released exactly one plan), so
        # at batch 1 the GPU idled for a whole control-loop round trip between tokens.
        while (plan := self._maybe_schedule()) is not None:
            out.append((KV_CACHE_MANAGER, plan))
        out.extend((BUS, event) for event in self._events)
        return out

    # ------------------------------------------------------------------ requests
    def _add(self, message: AddRequest) -> list[tuple[str, Message]]:
        if message.resume and message.request_id in self.requests:
            return catch_up(self.requests[message.request_id], message)
        error = identity_error(message, self.requests)
        if error is None:
            error = admission_error(message, self.config)
            if error is None and self.config.reject_unmeetable:
                ahead = queue_ahead(self.policy, self.waiting, message, self._num_arrivals) + self.running
                error = unmeetable_error(message, ahead, len(self.running),
                                         self.cost_model, self.config.max_num_batched_tokens,
                                         self.config.max_num_seqs)
            if error is not None:  # a well-formed id of no other request: its timeline says why
                self._events.append(Aborted(request_id=message.request_id, reason="error"))
        if error is not None:  # answered to its sender only; nothing else changed
            update = RequestUpdate(request_id=message.request_id, finish_reason="error", error=error)
            return [(FRONTEND, RequestUpdates(step_id=-1, updates=[update]))]
        request = ScheduledRequest(
            request_id=message.request_id,
            prompt_token_ids=list(message.prompt_token_ids),
            params=message.params,
            eos_token_ids=list(message.eos_token_ids),
            packed_prompt=pack_token_ids(message.prompt_token_ids),
            output_token_ids=list(message.output_token_ids),
            # A resubmission with outputs resumes as after a preemption (RESUMED, recompute).
            num_preemptions=1 if message.output_token_ids else 0,
            priority=message.priority,
            ttft_deadline=message.ttft_deadline,
            e2e_deadline=message.e2e_deadline,
            arrival=self._num_arrivals,
            queued_at_step=self.stats.num_steps,
        )
        self._num_arrivals += 1
        if request.output_token_ids:
            finish_reason, stop_reason = check_stop(request, request.output_token_ids[-1], self.config.max_model_len)
            if finish_reason is not None:  # its last token ended it: the client missed only that
                self._events.append(
                    Finished(request_id=request.request_id, reason=finish_reason,
                             num_prompt_tokens=len(request.prompt_token_ids),
                             num_output_tokens=len(request.output_token_ids), stop_reason=stop_reason)
                )
                update = RequestUpdate(request_id=request.request_id, finish_reason=finish_reason,
                                       stop_reason=stop_reason, num_prompt_tokens=len(request.prompt_token_ids))
                return [(FRONTEND, RequestUpdates(step_id=-1, updates=[update]))]
        self.requests[request.request_id] = request
        self.waiting.append(request)
        self._events.append(Queued(request_id=request.request_id, num_waiting=len(self.waiting),
                                   priority=message.priority, ttft_deadline=message.ttft_deadline,
                                   e2e_deadline=message.e2e_deadline))
        return []

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

    def _release(self, request: ScheduledRequest) -> None:
        self.ledger.release(request.request_id)
        if request.in_worker:
            self._departed.append(request.request_id)
            request.in_worker = False

    # ------------------------------------------------------------------ scheduling
    def _maybe_schedule(self) -> StepPlan | None:
        if len(self._in_flight) >= self.config.max_steps_in_flight:
            return None
        if not (self.waiting or self.running or self._departed or self._reset_pending):
            return None
        plan, sampling_ids = self._schedule()
        if not plan.req_ids and not plan.finished_ids and not plan.reset:
            return None  # everything waits for tokens in flight
        if plan.reset:  # sent even when empty: the KV-cache manager and workers drop their state
            self._reset_pending = False
            self._reset_step = self._min_step_id = plan.step_id
        self._in_flight.append((plan, sampling_ids))
        self._next_step_id += 1
        self.stats.num_steps += 1
        return plan

    def _wants_more(self, request: ScheduledRequest) -> bool:
        """False once the tokens in flight already take it to max_tokens or max_model_len."""
        target = len(request.output_token_ids) + request.num_pending
        max_tokens = request.params.max_tokens
        if request.num_pending and max_tokens is not None and target >= max_tokens:
            return False
        return not (request.num_pending and request.num_tokens_with_pending >= self.config.max_model_len)

    def _blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.config.block_size)

    def _blocks_needed(self, request: ScheduledRequest, num_new: int) -> int:
        held = self.ledger.num_blocks(request.request_id)
        return self._blocks_for(request.num_computed_tokens + num_new) - held

    def _schedule(self) -> tuple[StepPlan, list[str]]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[ScheduledRequest, int]] = []
        new_requests: list[NewRequest] = []
        cached: dict[str, list[int]] = {}  # hashes of the blocks scheduled requests cache this step
        preempted_now = False

        self.policy.step = self.stats.num_steps
        if isinstance(self.policy, LeastRemainingSlack):
            self.policy.batch = max(1, len(self.running))
        self.policy.order_running(self.running)  # most urgent first: the last one is preempted
        if len(self.running) >= self.config.max_num_seqs and self.waiting:
            self.waiting = self.policy.order_waiting(self.waiting, self.ledger)
            for victim in slot_victims(self.policy, self.waiting, self.running, self.config.max_num_seqs, budget):
                self._preempt(victim)  # a more urgent waiting request takes its slot below
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens_with_pending - request.num_computed_tokens, budget)
            if num_new <= 0 or not self._wants_more(request):
                index += 1
                continue
            needed = self._blocks_needed(request, num_new)
            while needed > self.ledger.num_available:
                victim = self.running[-1]
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
            if request.status is not Status.RUNNING:
                break  # it preempted itself: everything after it is gone too
            self._allocate(request, num_new, needed, cached)
            scheduled.append((request, num_new))
            budget -= num_new
            index += 1

        if not preempted_now:
            self.waiting = self.policy.order_waiting(self.waiting, self.ledger)
        while self.waiting and budget > 0 and not preempted_now:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            if request.num_pending:
                break  # preempted while a step was in flight: resume once its token is here
            num_query, num_hit, hit_hash = admit(request, self.ledger)
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = min(remaining, budget)
            needed = self._blocks_needed(request, num_new)
            if (remaining > budget and not self.config.enable_chunked_prefill) or needed > self.ledger.num_available:
                self.ledger.release(request.request_id)  # not now: give the hit back
                request.num_computed_tokens = 0
                break
            self.waiting.popleft()
            request.status = Status.RUNNING
            self.running.append(request)
            admitted = Resumed if request.num_preemptions else Scheduled
            if not request.num_preemptions and not request.output_token_ids:
                request.num_cached_prompt_tokens = min(num_hit, len(request.prompt_token_ids))
            self._events.append(
                admitted(
                    request_id=request.request_id,
                    step_id=self._next_step_id,
                    num_query_tokens=num_query,
                    num_cached_tokens=num_hit,
                )
            )
            # Cached now, so that a request admitted later in this pass already hits them.
            self._allocate(request, num_new, needed, cached)
            new_requests.append(self._new_request(request, num_hit, hit_hash))
            scheduled.append((request, num_new))
            budget -= num_new

        sampling_ids: list[str] = []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            target = request.num_tokens_with_pending
            if start + num_new < target:
                self.stats.num_prefill_chunks += 1
            else:
                sampling_ids.append(request.request_id)
                request.num_pending += 1
            if target - start > 1 or not request.output_token_ids:  # prefill, not decode
                self._events.append(
                    PrefillChunk(
                        request_id=request.request_id,
                        step_id=self._next_step_id,
                        start=start,
                        num_tokens=num_new,
                        last=start + num_new == target,
                    )
                )
            request.num_computed_tokens += num_new

        plan = StepPlan(
            step_id=self._next_step_id,
            reset=self._reset_pending,
            new_requests=new_requests,
            finished_ids=self._departed,
            req_ids=[request.request_id for request, _ in scheduled],
            num_tokens=[num_new for _, num_new in scheduled],
            num_blocks=[self.ledger.num_blocks(request.request_id) for request, _ in scheduled],
            evicted_hashes=self.ledger.take_evicted(),
            cached_hashes=cached,
        )
        self._departed = []
        return plan, sampling_ids

    def _allocate(self, request: ScheduledRequest, num_new: int, needed: int, cached: dict[str, list[int]]) -> None:
        """Give the request ``needed`` more blocks for ``num_new`` tokens this step, then cache
        its full blocks whose KV this step (or an earlier one) writes and whose tokens are known
        (a decode step's input may still be in flight: cached in a later pass); their hashes go
        into ``cached`` for the KV-cache manager."""
        self.ledger.allocate(request.request_id, needed)
        computed = min(request.num_computed_tokens + num_new, request.num_tokens)
        if self.ledger.cache is None or computed < request.cache_check_at:
            return
        hashes = self.ledger.cache_blocks(request.request_id, computed // self.config.block_size, request.token_slice)
        request.cache_check_at = self.ledger.next_cache_check(request.request_id)
        if hashes:
            cached[request.request_id] = hashes

    def _new_request(self, request: ScheduledRequest, num_hit: int, hit_hash: int) -> NewRequest:
        request.in_worker = True
        return NewRequest(
            request_id=request.request_id,
            token_ids=request.packed_prompt + pack_token_ids(request.output_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            num_output_tokens=len(request.output_token_ids),
            params=request.params,
            eos_token_ids=request.eos_token_ids,
            num_cached_tokens=num_hit,
            cached_block_hash=hit_hash,
        )

    def _preempt(self, request: ScheduledRequest) -> None:
        self._events.append(
            Preempted(
                request_id=request.request_id,
                step_id=self._next_step_id,
                num_computed_tokens=request.num_computed_tokens,
            )
        )
        self.running.remove(request)
        self._release(request)
        request.num_computed_tokens = 0
        request.status = Status.WAITING
        request.num_preemptions += 1
        request.queued_at_step = self.stats.num_steps
        self.stats.num_preemptions += 1
        self.waiting.appendleft(request)
