"""``POST /v1/completions``: OpenAI's legacy completions, streaming or not."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import CompletionOutput, RequestOutput
from vllm_actors.actors.frontend.text import PromptInput
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.server.errors import OpenAIError, bad_request
from vllm_actors.server.fields import check_fields, text_options
from vllm_actors.server.logprobs import completion_logprobs, prompt_logprobs_body
from vllm_actors.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptShapeError,
    encode,
    normalize_prompts,
    now,
    usage,
)
from vllm_actors.server.serving import (
    ServerState,
    decode_body,
    request_id,
    sampling_params,
    session_key,
)
from vllm_actors.server.streaming import (
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    abort_all,
    final_output,
    guarded_events,
    merge_streams,
    sse,
    unless_disconnected,
)


@dataclass
class _Job:
    response_id: str
    created: int
    model: str
    body: CompletionRequest
    prepared: list[PreparedRequest]
    prompt_texts: list[str]  # for echo
    decode: Callable[[int], str]  # one token's text
    error_of: Callable[[RequestOutput], OpenAIError]  # a request that ended with an error
    echo_only: bool  # echo with max_tokens 0: the prompt alone
    as_ids: bool  # tokens as "token_id:<id>"
    details: bool = False  # --enable-prompt-tokens-details


async def create_completion(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, CompletionRequest, state.limits.max_body_bytes)
    model = state.check_model(body.model)
    check_fields(body, "completions")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request(f"best_of: only best_of == n is supported, got best_of={body.best_of}, n={body.n}", "best_of")
    if body.prompt == "":  # vLLM's words
        raise bad_request("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    try:
        prompts = normalize_prompts(body.prompt, max_tokens=state.client.max_model_len)
    except PromptShapeError as error:
        raise bad_request(str(error), "prompt") from None
    state.check_logprobs("logprobs", body.logprobs)
    state.check_logprobs("prompt_logprobs", body.prompt_logprobs)
    if body.stream and body.prompt_logprobs is not None and body.prompt_logprobs != 0:
        raise bad_request("prompt_logprobs: not available when stream is true", "prompt_logprobs")
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo:  # vLLM: echo's logprobs are the prompt's
        prompt_logprobs = body.logprobs
    echo_only = body.echo and body.max_tokens == 0  # vLLM: the prompt (and its logprobs), one token generated
    max_tokens = 1 if echo_only else body.max_tokens
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, prompt_logprobs=prompt_logprobs,
                             vocab_size=state.client.vocab_size)
    engine_id = response_id = request_id("cmpl", request, body.request_id)
    options = text_options(body, state.client.max_model_len, max_tokens)
    prepared = []
    for index, prompt in enumerate(prompts):
        prompt_input: PromptInput = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        prepared.append(await state.prepare(f"{engine_id}-{index}", prompt_input, params, options))
    sticky = session_key(request, body.user)
    if sticky is not None:
        prepared = [dataclasses.replace(p, session_key=sticky) for p in prepared]
    prompt_texts = await state.prompt_texts(prepared) if body.echo else [""] * len(prepared)
    as_ids = body.return_tokens_as_token_ids
    job = _Job(response_id, now(), model, body, prepared, prompt_texts,
               lambda token_id: state.token_text(token_id, as_ids), state.output_error, echo_only,
               bool(as_ids if as_ids is not None else state.options.return_tokens_as_token_ids),
               state.options.prompt_tokens_details)
    prepared = state.with_schedule(prepared, body, "completions")
    streams = state.submit(prepared)
    if body.stream:
        return EventStreamResponse(guarded_events(_stream(job, streams), streams, request), streams)
    try:
        outputs = await unless_disconnected(request, streams, lambda: _collect(job, streams))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        abort_all(streams, "abort")
    return Response(encode(_response(job, outputs)), media_type="application/json")


async def _collect(job: _Job, streams: Sequence[RequestStream]) -> list[RequestOutput]:
    outputs = [await final_output(stream) for stream in streams]
    for output in outputs:
        if output.error is not None:
            raise job.error_of(output)
    return outputs


def _choice_index(job: _Job, prompt_index: int, completion: CompletionOutput) -> int:
    return prompt_index * job.body.n + completion.index


def _echo_logprobs(job: _Job, output: RequestOutput) -> tuple[CompletionLogprobs, int]:
    prompt_positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    return completion_logprobs(output.prompt_token_ids, prompt_positions, 0, job.decode, job.as_ids)


def _response(job: _Job, outputs: list[RequestOutput]) -> CompletionResponse:
    choices = []
    num_prompt = num_generated = 0
    for prompt_index, output in enumerate(outputs):
        num_prompt += len(output.prompt_token_ids)
        for completion in output.outputs:
            num_generated += len(completion.token_ids)
            text = "" if job.echo_only else completion.text
            logprobs = None
            if job.body.logprobs is not None:
                offset = 0
                logprobs = CompletionLogprobs()
                if job.body.echo:
                    logprobs, offset = _echo_logprobs(job, output)
                if not job.echo_only:
                    generated, _ = completion_logprobs(completion.token_ids, completion.logprobs or [], offset,
                                                       job.decode, job.as_ids)
                    _extend(logprobs, generated)
            if job.body.echo:
                text = job.prompt_texts[prompt_index] + text
            with_ids = bool(job.body.return_token_ids)
            choices.append(CompletionChoice(
                index=_choice_index(job, prompt_index, completion), text=text, logprobs=logprobs,
                finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
                token_ids=list(completion.token_ids) if with_ids else None,
                prompt_logprobs=prompt_logprobs_body(output.prompt_logprobs),  # whenever computed (vLLM)
                prompt_token_ids=list(output.prompt_token_ids) if with_ids else None,
            ))
    choices.sort(key=lambda choice: choice.index)
    return CompletionResponse(
        id=job.response_id, created=job.created, model=job.model, choices=choices,
        usage=usage(num_prompt, num_generated, sum(o.num_cached_tokens for o in outputs) if job.details else None),
    )


def _extend(into: CompletionLogprobs, more: CompletionLogprobs) -> None:
    into.text_offset.extend(more.text_offset)
    into.token_logprobs.extend(more.token_logprobs)
    into.tokens.extend(more.tokens)
    into.top_logprobs.extend(more.top_logprobs)


@dataclass
class _Cursor:
    """How much of one choice has been streamed."""

    text: int = 0
    tokens: int = 0
    offset: int = 0  # text offset for logprobs
    started: bool = False
    done: bool = False


async def _stream(job: _Job, streams: Sequence[RequestStream]) -> AsyncIterator[bytes]:
    body = job.body
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
    cursors: dict[int, _Cursor] = {}
    prompt_tokens = [len(p.prompt_token_ids) for p in job.prepared]
    generated: dict[int, int] = {}
    cached: dict[int, int] = {}  # prompt index -> its prompt tokens found in the prefix cache

    def chunk(choice: CompletionChoice, prompt_index: int) -> bytes:
        counts = None
        if continuous:  # vLLM: this choice's prompt and its tokens so far
            counts = usage(prompt_tokens[prompt_index], generated[choice.index])
        message = CompletionChunk(id=job.response_id, created=job.created, model=job.model, choices=[choice])
        if include_usage:
            message.usage = counts
        return sse(message)

    error: OpenAIError | None = None
    async for prompt_index, output, step in merge_streams(streams):
        if output.error is not None and error is None:
            error = job.error_of(output)  # raised once every choice has streamed its end
        for completion in output.outputs:
            index = _choice_index(job, prompt_index, completion)
            cursor = cursors.setdefault(index, _Cursor())
            if cursor.done:
                continue
            text_end, end, finished = step[completion.index]  # where this step left it (the lists grow since)
            generated[index] = end
            cached[prompt_index] = output.num_cached_tokens
            delta = "" if job.echo_only else completion.text[cursor.text:text_end]
            logprobs = None
            first = not cursor.started
            if first:
                cursor.started = True
                if body.echo:
                    delta = job.prompt_texts[prompt_index] + delta
                    if body.logprobs is not None:
                        logprobs, cursor.offset = _echo_logprobs(job, output)
            new_ids = completion.token_ids[cursor.tokens:end]
            if body.logprobs is not None and completion.logprobs is not None and not job.echo_only:
                more, cursor.offset = completion_logprobs(new_ids, completion.logprobs[cursor.tokens:end],
                                                          cursor.offset, job.decode, job.as_ids)
                if logprobs is None:
                    logprobs = more
                else:
                    _extend(logprobs, more)
            cursor.text = text_end
            cursor.tokens = end
            if not delta and not finished and not new_ids:
                continue  # nothing new for this choice in this step
            cursor.done = finished  # vLLM: a chunk per step with tokens, its text "" when held back
            choice = CompletionChoice(index=index, text=delta, logprobs=logprobs,
                                      finish_reason=completion.finish_reason if finished else None,
                                      stop_reason=completion.stop_reason if finished else None)
            if body.return_token_ids:  # vLLM: the prompt's ids in a choice's first chunk, then the new ids
                choice.token_ids = list(new_ids)
                if first:
                    choice.prompt_token_ids = list(output.prompt_token_ids)
            yield chunk(choice, prompt_index)
    if error is not None:  # the choices ended with finish_reason "error"; the error event says why
        raise error
    if include_usage:
        total_prompt = sum(prompt_tokens)
        completion_tokens = sum(generated.values())
        yield sse(CompletionChunk(
            id=job.response_id, created=job.created, model=job.model, choices=[],
            usage=usage(total_prompt, completion_tokens, sum(cached.values()) if job.details else None),
        ))
    yield SSE_DONE
