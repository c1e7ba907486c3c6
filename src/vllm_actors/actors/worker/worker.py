"""The worker: keeps each running request's tokens and block table, runs the step, samples.

Pure state machine around a model runner (the clock that times a step is injected):
``handle(StepPlan)`` returns one ``StepResult`` for the scheduler. Because the worker appends
every token it samples to the request's own token list, a decode step needs nothing from the plan
but the request id - the next step's input is already here.

A ``reset`` plan (the pipeline restarts after an actor was restarted) first drops every request
and block-table row; its result carries ``reset`` back to the scheduler. The KV tensors are left
as they are: every request comes back as new and recomputes what it reads. A plan with a step id
below the last reset plan's was planned before it (its blocks may be someone else's now) and is
dropped without running.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_actors.actors.worker.block_tables import BlockTableArray
from vllm_actors.actors.worker.model_runner import BatchInput
from vllm_actors.actors.worker.sampler import Sampler, SamplingRow, top_logprobs
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.events import StepFinished, StepStarted
from vllm_actors.protocol.messages import Logprobs, Message, NewRequest, PromptLogprobs, StepPlan, StepResult
from vllm_actors.protocol.names import BUS, SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams


class Runner(Protocol):
    def execute(self, batch: BatchInput) -> torch.Tensor: ...


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


@dataclass
class _PromptSpan:
    request: WorkerRequest
    first_row: int  # first row of this span in the logits
    first_target: int  # prompt position whose logprob the first row gives
    count: int


class Worker:
    name = "worker"

    def __init__(self, runner: Runner, sampler: Sampler, clock: Callable[[], float]) -> None:
        """``clock``: seconds (the shell passes ``time.perf_counter``), to time each step."""
        self.runner = runner
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
        self.validate(message)
        num_prefill = sum(1 for new in message.new_requests if new.request_id in message.req_ids)
        started = StepStarted(
            step_id=message.step_id,
            num_seqs=len(message.req_ids),
            num_tokens=sum(message.num_tokens),
            num_prefill_seqs=num_prefill,
        )
        result = self.execute(message)
        finished = StepFinished(
            step_id=message.step_id,
            num_seqs=len(message.req_ids),
            num_tokens=result.num_batched_tokens,
            num_sampled=len(result.req_ids),
            execute_ms=result.execute_seconds * 1e3,
        )
        return [(SCHEDULER, result), (BUS, started), (BUS, finished)]

    def validate(self, plan: StepPlan) -> None:
        """Reject a plan that names unknown requests or asks for tokens that do not exist
        (``MessageRejected``), before any state changes."""
        if not len(plan.req_ids) == len(plan.num_tokens) == len(plan.new_block_ids):
            raise MessageRejected("req_ids, num_tokens and new_block_ids differ in length")
        held_requests = {} if plan.reset else self.requests  # a reset plan starts from nothing
        computed = {
            request_id: (request.num_computed_tokens, len(request.token_ids))
            for request_id, request in held_requests.items()
            if request_id not in plan.finished_ids
        }
        for new in plan.new_requests:
            if len(new.token_ids) % 4:
                raise MessageRejected(f"new request {new.request_id!r}: packed token ids take 4 bytes each")
        computed.update({new.request_id: (new.num_cached_tokens, new.num_tokens) for new in plan.new_requests})
        num_blocks = getattr(self.runner, "num_blocks", None)
        for request_id, num_new, blocks in zip(plan.req_ids, plan.num_tokens, plan.new_block_ids, strict=True):
            if request_id not in computed:
                raise MessageRejected(f"plan schedules unknown request {request_id!r}")
            done, known = computed[request_id]
            if not 1 <= num_new <= known - done:
                raise MessageRejected(f"plan schedules {num_new} tokens for {request_id!r}, {known - done} pending")
            if num_blocks is not None and any(not 0 <= block < num_blocks for block in blocks):
                raise MessageRejected(f"plan gives {request_id!r} a block outside the pool")
            fresh = request_id in plan.finished_ids or request_id not in held_requests or any(
                new.request_id == request_id for new in plan.new_requests
            )
            held = 0 if fresh else len(held_requests[request_id].block_table)
            if self.tables is not None and held + len(blocks) > self.tables.width:
                raise MessageRejected(f"plan gives {request_id!r} more blocks than a sequence may hold")

    def _drop(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is not None and self.tables is not None:
            self.tables.remove(request.row)

    def _admit(self, new: NewRequest) -> None:
        self._drop(new.request_id)
        self.requests[new.request_id] = WorkerRequest(
            request_id=new.request_id,
            token_ids=new.token_list(),
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
        if self.tables is not None:
            self.tables = BlockTableArray(self.tables.width)

    def execute(self, plan: StepPlan) -> StepResult:
        started = self.clock()
        if plan.reset:
            self.reset()
            self._min_step_id = plan.step_id
        for request_id in plan.finished_ids:
            self._drop(request_id)
        for new in plan.new_requests:
            self._admit(new)

        batch = BatchInput([], [], [], [], [], [])
        samplers: list[WorkerRequest] = []
        sample_rows: list[int] = []  # rows of the logits that are sampled
        spans: list[_PromptSpan] = []
        for request_id, num_new, new_blocks in zip(
            plan.req_ids, plan.num_tokens, plan.new_block_ids, strict=True
        ):
            request = self.requests[request_id]
            request.block_table.extend(new_blocks)
            if self.tables is not None:
                self.tables.append(request.row, new_blocks)
            start = request.num_computed_tokens
            end = start + num_new
            if end > len(request.token_ids):
                raise ValueError(f"{request_id}: asked to compute {end} tokens, {len(request.token_ids)} known")
            flat_start = len(batch.token_ids)
            batch.token_ids.extend(request.token_ids[start:end])
            batch.positions.extend(range(start, end))
            batch.query_lens.append(num_new)
            batch.seq_lens.append(end)
            batch.block_tables.append(request.block_table)
            if request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
                last = min(end, request.num_prompt_tokens - 1)
                spans.append(_PromptSpan(request, len(batch.logits_indices), start + 1, last - start))
                batch.logits_indices.extend(range(flat_start, flat_start + last - start))
            request.num_computed_tokens = end
            if end == len(request.token_ids):
                samplers.append(request)
                sample_rows.append(len(batch.logits_indices))
                batch.logits_indices.append(flat_start + num_new - 1)

        if not batch.token_ids:
            return StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=[], token_ids=[])
        if self.tables is not None:
            batch.block_table_array = self.tables.gather(
                [self.requests[request_id].row for request_id in plan.req_ids]
            )
        logits = self.runner.execute(batch)

        prompt_logprobs = [self._prompt_logprobs(span, logits) for span in spans]
        rows = [
            SamplingRow(request.params, request.num_output_tokens, request.min_tokens_stop_ids)
            for request in samplers
        ]
        sampled = self.sampler(logits[sample_rows], rows) if samplers else None
        token_ids = sampled.token_ids if sampled else []
        for request, token_id in zip(samplers, token_ids, strict=True):
            request.token_ids.append(token_id)
            request.num_output_tokens += 1
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

    @staticmethod
    def _prompt_logprobs(span: _PromptSpan, logits: torch.Tensor) -> PromptLogprobs:
        request = span.request
        rows = logits[span.first_row : span.first_row + span.count]
        targets = torch.tensor(
            request.token_ids[span.first_target : span.first_target + span.count],
            dtype=torch.long,
            device=rows.device,
        )
        entries = top_logprobs(torch.log_softmax(rows.float(), dim=-1), targets, request.params.prompt_logprobs or 0)
        return PromptLogprobs(request_id=request.request_id, start=span.first_target, entries=entries)
