"""A worker's step result as the scheduler takes it: stale results (of plans sent before a
pipeline reset) are ignored; otherwise each sampled token is appended, stops are checked, the cost
model learns the step's time, and the frontend gets the step's updates (FIRST_TOKEN, TOKENS,
FINISHED on the bus). Functions over the ``Scheduler`` (as ``recovery`` is)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_actors.actors.scheduler.deadlines import observe_step
from vllm_actors.actors.scheduler.request import check_stop
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.events import Finished, FirstToken, Tokens
from vllm_actors.protocol.messages import Message, RequestUpdate, RequestUpdates, StepResult
from vllm_actors.protocol.names import FRONTEND

if TYPE_CHECKING:
    from vllm_actors.actors.scheduler.scheduler import Scheduler


def is_stale(scheduler: Scheduler, result: StepResult) -> bool:
    """A result of a plan sent before the last pipeline reset (or by a previous scheduler)."""
    if scheduler._reset_pending:
        return True  # the reset plan is not even sent: nothing in flight is ours
    if scheduler._reset_step is not None:
        return not (result.reset and result.step_id == scheduler._reset_step)
    return result.step_id < scheduler._min_step_id


def on_step_result(scheduler: Scheduler, result: StepResult) -> list[tuple[str, Message]]:
    if is_stale(scheduler, result):
        scheduler.stats.num_stale_results += 1
        return []
    if result.reset:
        scheduler._reset_step = None  # the pipeline is ours again: results match plans in order
    if not scheduler._in_flight or result.step_id != scheduler._in_flight[0][0].step_id:
        raise MessageRejected(f"unexpected step result {result.step_id}")
    plan, sampling_ids = scheduler._in_flight.popleft()
    observe_step(scheduler.cost_model, plan, result)  # the step cost model learns from the measured step
    for request_id in sampling_ids:
        request = scheduler.requests.get(request_id)
        if request is not None:
            request.num_pending -= 1
    updates: list[RequestUpdate] = []
    tokens_ids: list[str] = []
    tokens_counts: list[int] = []
    first_tokens: list[FirstToken] = []
    finished: list[Finished] = []
    prompt_logprobs = {chunk.request_id: chunk for chunk in result.prompt_logprobs}
    for index, (request_id, token_id) in enumerate(zip(result.req_ids, result.token_ids, strict=True)):
        request = scheduler.requests.get(request_id)
        if request is None:  # finished or aborted while the step ran: the token is dropped
            continue
        request.output_token_ids.append(token_id)
        tokens_ids.append(request_id)
        tokens_counts.append(len(request.output_token_ids))
        if len(request.output_token_ids) == 1:
            first_tokens.append(FirstToken(request_id=request_id, step_id=result.step_id))
        finish_reason, stop_reason = check_stop(request, token_id, scheduler.config.max_model_len)
        chunk = prompt_logprobs.pop(request_id, None)
        logprobs = result.logprobs[index] if result.logprobs else None
        update = RequestUpdate(
            request_id=request_id,
            new_token_ids=[token_id],
            output_index=len(request.output_token_ids) - 1,
            logprobs=[logprobs] if logprobs else None,
            prompt_logprobs=chunk.entries if chunk else None,
            prompt_logprobs_start=chunk.start if chunk else 0,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_prompt_tokens if len(request.output_token_ids) == 1 else 0,
        )
        updates.append(update)
        if finish_reason is not None:
            finished.append(
                Finished(
                    request_id=request_id,
                    reason=finish_reason,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    num_output_tokens=len(request.output_token_ids),
                    stop_reason=stop_reason,
                )
            )
            scheduler._finish(request_id)
    # Lifecycle order within a step: FIRST_TOKEN, then the step's TOKENS, then FINISHED.
    scheduler._events.extend(first_tokens)
    if tokens_ids:
        scheduler._events.append(Tokens(step_id=result.step_id, request_ids=tokens_ids,
                                   num_output_tokens=tokens_counts))
    scheduler._events.extend(finished)
    for request_id, chunk in prompt_logprobs.items():  # prompt chunks that sampled nothing yet
        if request_id in scheduler.requests:
            updates.append(
                RequestUpdate(
                    request_id=request_id,
                    prompt_logprobs=chunk.entries,
                    prompt_logprobs_start=chunk.start,
                )
            )
    if not updates:
        return []
    return [(FRONTEND, RequestUpdates(step_id=result.step_id, updates=updates, step_finished_at=result.finished_at))]
