"""A step's result applied to the requests: each sampled token appended, stops checked, the
frontend's updates and the lifecycle events (FIRST_TOKEN, TOKENS, FINISHED) built. The scheduler
matches the result to its plan first (``pipeline``) and finishes the requests that stopped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
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


def token_runs(req_ids: list[str]) -> Iterator[tuple[str, int, int]]:
    """(request id, start, end) of each run of one request's consecutive entries."""
    start = 0
    for index in range(1, len(req_ids) + 1):
        if index == len(req_ids) or req_ids[index] != req_ids[start]:
            yield req_ids[start], start, index
            start = index


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
    for request_id, start, end in token_runs(result.req_ids):
        request = requests.get(request_id)
        if request is None:
            continue
        new_token_ids: list[int] = []
        finish_reason: str | None = None
        stop_reason: int | None = None
        for token_id in result.token_ids[start:end]:  # several after verified drafts; the first stop ends them
            request.output_token_ids.append(token_id)
            new_token_ids.append(token_id)
            finish_reason, stop_reason = check_stop(request, token_id, max_model_len)
            if finish_reason is not None:
                break
        num_output = len(request.output_token_ids)
        tokens_ids.append(request_id)
        tokens_counts.append(num_output)
        if num_output == len(new_token_ids):
            first_tokens.append(FirstToken(request_id=request_id, step_id=result.step_id))
            computed_prompt += len(request.prompt_token_ids) - request.num_cached_prompt_tokens
        chunk = prompt_logprobs.pop(request_id, None)
        logprobs = [e for e in result.logprobs[start : start + len(new_token_ids)] if e is not None] \
            if result.logprobs else []
        step.updates.append(RequestUpdate(
            request_id=request_id,
            new_token_ids=new_token_ids,
            output_index=num_output - len(new_token_ids),
            logprobs=logprobs if logprobs and len(logprobs) == len(new_token_ids) else None,
            prompt_logprobs=chunk.entries if chunk else None,
            prompt_logprobs_start=chunk.start if chunk else 0,
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=len(request.prompt_token_ids),
            num_cached_tokens=request.num_cached_prompt_tokens if num_output == len(new_token_ids) else 0,
        ))
        if finish_reason is not None:
            finished.append(Finished(request_id=request_id, reason=finish_reason,
                                     num_prompt_tokens=len(request.prompt_token_ids),
                                     num_output_tokens=num_output, stop_reason=stop_reason,
                                     num_draft_tokens=request.num_draft_tokens,
                                     num_accepted_tokens=request.num_accepted_tokens))
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
