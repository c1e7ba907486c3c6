"""A step's result applied to the requests: each sampled token appended, stops checked, the
frontend's updates and the lifecycle events (FIRST_TOKEN, TOKENS, FINISHED) built. The scheduler
matches the result to its plan first (``pipeline``) and finishes the requests that stopped."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.actors.scheduler.request import ScheduledRequest, check_stop
from vllm_actors.protocol.events import Finished, FirstToken, Tokens
from vllm_actors.protocol.messages import RequestUpdate, StepResult


@dataclass
class StepTokens:
    """What a step's result did: the frontend's updates, the events in lifecycle order (every
    FIRST_TOKEN, then the step's TOKENS, then every FINISHED) and the requests that stopped."""

    updates: list[RequestUpdate] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)


def apply_result(requests: Mapping[str, ScheduledRequest], sampling_ids: Iterable[str], result: StepResult,
                 max_model_len: int) -> StepTokens:
    """``sampling_ids``: the requests the step's plan samples for (their token is no longer
    pending). A request finished or aborted while the step ran is not in ``requests``: its token
    is dropped."""
    for request_id in sampling_ids:
        pending = requests.get(request_id)
        if pending is not None:
            pending.num_pending -= 1
    step = StepTokens()
    tokens_ids: list[str] = []
    tokens_counts: list[int] = []
    first_tokens: list[FirstToken] = []
    computed_prompt = 0  # prompt tokens the requests getting their first token computed
    finished: list[Finished] = []
    prompt_logprobs = {chunk.request_id: chunk for chunk in result.prompt_logprobs}
    for index, (request_id, token_id) in enumerate(zip(result.req_ids, result.token_ids, strict=True)):
        request = requests.get(request_id)
        if request is None:
            continue
        request.output_token_ids.append(token_id)
        num_output = len(request.output_token_ids)
        tokens_ids.append(request_id)
        tokens_counts.append(num_output)
        if num_output == 1:
            first_tokens.append(FirstToken(request_id=request_id, step_id=result.step_id))
            computed_prompt += len(request.prompt_token_ids) - request.num_cached_prompt_tokens
        finish_reason, stop_reason = check_stop(request, token_id, max_model_len)
        chunk = prompt_logprobs.pop(request_id, None)
        logprobs = result.logprobs[index] if result.logprobs else None
        step.updates.append(RequestUpdate(
            request_id=request_id,
            new_token_ids=[token_id],
            output_index=num_output - 1,
            logprobs=[logprobs] if logprobs else None,
            prompt_logprobs=chunk.entries if chunk else None,
            prompt_logprobs_start=chunk.start if chunk else 0,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_prompt_tokens if num_output == 1 else 0,
        ))
        if finish_reason is not None:
            finished.append(Finished(request_id=request_id, reason=finish_reason,
                                     num_prompt_tokens=len(request.prompt_token_ids),
                                     num_output_tokens=num_output, stop_reason=stop_reason))
            step.finished_ids.append(request_id)
    step.events.extend(first_tokens)
    if tokens_ids:
        step.events.append(Tokens(step_id=result.step_id, request_ids=tokens_ids, num_output_tokens=tokens_counts,
                                  num_computed_prompt_tokens=computed_prompt))
    step.events.extend(finished)
    for request_id, chunk in prompt_logprobs.items():  # prompt chunks that sampled nothing yet
        if request_id in requests:
            step.updates.append(RequestUpdate(request_id=request_id, prompt_logprobs=chunk.entries,
                                              prompt_logprobs_start=chunk.start))
    return step
