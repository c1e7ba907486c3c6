"""``POST /v1/chat/completions``: messages through the model's chat template, streaming or not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.protocol.sampling import MAX_LOGPROBS
from vllm_actors.server.errors import OpenAIError, bad_request
from vllm_actors.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    Usage,
    encode,
    now,
)
from vllm_actors.server.serving import (
    SSE_DONE,
    ClientDisconnected,
    EventStreamResponse,
    ServerState,
    abort_all,
    chat_logprobs,
    decode_body,
    final_output,
    guarded_events,
    request_id,
    sampling_params,
    sse,
    unless_disconnected,
)


@dataclass
class _Job:
    response_id: str
    created: int
    model: str
    body: ChatCompletionRequest
    prepared: PreparedRequest


def conversation(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them; text content parts are joined by newlines."""
    if not messages:
        raise bad_request("messages: must hold at least one message", "messages")
    result = []
    for position, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(
                        f"messages[{position}].content: content parts of type {part.type!r} are not supported "
                        "(text only)", "messages")
                texts.append(part.text)
            content = "\n".join(texts)
        entry: dict[str, Any] = {"role": message.role, "content": content if content is not None else ""}
        for name in ("name", "tool_calls", "tool_call_id"):
            value = getattr(message, name)
            if value is not None:
                entry[name] = value
        result.append(entry)
    return result


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, ChatCompletionRequest, state.limits.max_body_bytes)
    model = state.check_model(body.model)
    messages = conversation(body.messages)
    if body.tools and body.tool_choice != "none":  # OpenAI: "auto" when tools are given
        raise bad_request("tools: tool calling is not supported by this server", "tools")
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request(f"response_format: type {body.response_format.type!r} is not supported (text only)",
                          "response_format")
    if body.top_logprobs is not None:
        if not 0 <= body.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {body.top_logprobs}",
                              "top_logprobs")
        if body.top_logprobs > 0 and not body.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=body.prompt_logprobs)
    engine_id = response_id = request_id("chatcmpl", request)
    prepared = await state.prepare_chat(engine_id, messages, params, body.add_generation_prompt,
                                  dict(body.chat_template_kwargs or {}))
    job = _Job(response_id, now(), model, body, prepared)
    streams = state.submit([prepared])
    if body.stream:
        return EventStreamResponse(guarded_events(_stream(job, streams[0], state.output_error), streams, request),
                                   streams)
    try:
        output = await unless_disconnected(request, streams, lambda: final_output(streams[0]))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        abort_all(streams, "abort")
    if output.error is not None:
        raise state.output_error(output)
    return Response(encode(_response(job, output)), media_type="application/json")


def _usage(output: RequestOutput) -> Usage:
    prompt = len(output.prompt_token_ids)
    generated = sum(len(c.token_ids) for c in output.outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=generated, total_tokens=prompt + generated)


def _response(job: _Job, output: RequestOutput) -> ChatCompletionResponse:
    choices = []
    for completion in output.outputs:
        logprobs = None
        if job.body.logprobs:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs or [], job.body.top_logprobs or 0)
        choices.append(ChatChoice(
            index=completion.index, message=AssistantMessage(content=completion.text), logprobs=logprobs,
            finish_reason=completion.finish_reason, stop_reason=completion.stop_reason,
        ))
    return ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                                  usage=_usage(output))


async def _stream(job: _Job, stream: RequestStream,
                  error_of: Callable[[RequestOutput], OpenAIError]) -> AsyncIterator[bytes]:
    body = job.body
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    last: RequestOutput | None = None

    def chunk(choice: ChatStreamChoice, output: RequestOutput | None) -> bytes:
        message = ChatCompletionChunk(id=job.response_id, created=job.created, model=job.model, choices=[choice])
        if include_usage:
            message.usage = _usage(output) if continuous and output is not None else None
        return sse(message)

    for index in range(body.n):  # the role first, like OpenAI
        yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content="")),
                    None)
    error: OpenAIError | None = None
    async for output in stream:
        last = output
        if output.error is not None and error is None:
            error = error_of(output)  # raised once every choice has streamed its end
        for completion in output.outputs:
            index = completion.index
            if index in done:
                continue
            delta = completion.text[sent_text.get(index, 0):]
            first_token = sent_tokens.get(index, 0)
            new_ids = completion.token_ids[first_token:]
            sent_text[index] = len(completion.text)
            sent_tokens[index] = len(completion.token_ids)
            finished = completion.finish_reason is not None
            if not delta and not finished and not (new_ids and body.logprobs):
                continue  # nothing to show yet (text held back: a partial character or stop string)
            logprobs = None
            if body.logprobs and completion.logprobs is not None:
                logprobs = chat_logprobs(new_ids, completion.logprobs[first_token:], body.top_logprobs or 0)
            if finished:
                done.add(index)
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=delta), logprobs=logprobs,
                                         finish_reason=completion.finish_reason, stop_reason=completion.stop_reason),
                        output)
    if error is not None:  # the choices ended with finish_reason "error"; the error event says why
        raise error
    if include_usage and last is not None:
        yield sse(ChatCompletionChunk(id=job.response_id, created=job.created, model=job.model, choices=[],
                                      usage=_usage(last)))
    yield SSE_DONE
