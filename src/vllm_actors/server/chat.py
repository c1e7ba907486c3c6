"""``POST /v1/chat/completions``: messages through the model's chat template, streaming or not."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.server.errors import OpenAIError, bad_request
from vllm_actors.server.fields import check_fields, text_options
from vllm_actors.server.logprobs import chat_logprobs, prompt_logprobs_body
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
    usage,
)
from vllm_actors.server.reasoning import ReasoningStream, RequestReasoning
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
from vllm_actors.server.tool_parser import ParsedDelta, ToolParser, merge_calls
from vllm_actors.server.tools import (
    ToolPlan,
    ToolRequest,
    delta_tool_calls,
    history_tool_calls,
    plan_tools,
    tool_calls_body,
)


@dataclass
class _Job:
    response_id: str
    created: int
    model: str
    body: ChatCompletionRequest
    prepared: PreparedRequest
    role: str  # the reply's: the assistant's, or the last message's without a generation prompt
    echo: str  # echo: the last message's content, when it has the reply's role
    as_ids: bool  # tokens as "token_id:<id>"
    prompt_text: str | None  # return_prompt_text: the rendered template
    details: bool = False  # --enable-prompt-tokens-details
    tools: ToolPlan | None = None  # tool calls parsed out of the output
    reasoning: RequestReasoning | None = None  # --reasoning-parser: the thinking split off the content


def conversation(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template sees them; text content parts are joined by newlines; an
    assistant turn's ``reasoning`` is given to the template as ``reasoning`` and ``reasoning_content``."""
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
        for name in ("name", "tool_call_id"):
            value = getattr(message, name)
            if value is not None:
                entry[name] = value
        if message.tool_calls is not None:
            entry["tool_calls"] = history_tool_calls(message.tool_calls, position)
        reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
        if reasoning is not None and message.role == "assistant":  # templates read either name (vLLM sets both)
            entry["reasoning"] = entry["reasoning_content"] = reasoning
        result.append(entry)
    return result


async def create_chat_completion(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, ChatCompletionRequest, state.limits.max_body_bytes)
    return await chat_completion(body, request, state)


async def chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    """A decoded chat request served: the JSON response, or the SSE stream when ``body.stream``
    (other APIs served through the chat path, such as Anthropic's Messages, call this)."""
    job, streams = await start_chat(request, state, body)
    if body.stream:
        return EventStreamResponse(guarded_events(_stream(job, streams[0], state.output_error), streams, request),
                                   streams)
    output = await chat_output(request, state, streams)
    if output is None:
        return Response(status_code=499)
    return Response(encode(_response(job, output)), media_type="application/json")


async def chat_output(request: Request, state: ServerState, streams: list[RequestStream]) -> RequestOutput | None:
    """A non-streamed request's finished output (its error raised), or None when the client left."""
    try:
        output = await unless_disconnected(request, streams, lambda: final_output(streams[0]))
    except ClientDisconnected:
        return None
    finally:
        abort_all(streams, "abort")
    if output.error is not None:
        raise state.output_error(output)
    return output


async def start_chat(request: Request, state: ServerState, body: ChatCompletionRequest,
                     engine_id: str | None = None) -> tuple[_Job, list[RequestStream]]:
    """A chat request checked, prepared and submitted: its job (for ``_response`` and ``_stream``)
    and its stream. ``engine_id``: the request id to use (default: ``chatcmpl-`` and X-Request-Id)."""
    model = state.check_model(body.model)
    check_fields(body, "chat")
    messages = conversation(body.messages)
    tools = plan_tools(body, auto_enabled=state.options.enable_auto_tool_choice
                       and state.options.tool_call_parser is not None)
    if body.top_logprobs is not None:
        state.check_logprobs("top_logprobs", body.top_logprobs)
        if body.top_logprobs != 0 and not body.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
    state.check_logprobs("prompt_logprobs", body.prompt_logprobs)
    if body.stream and body.prompt_logprobs is not None and body.prompt_logprobs != 0:
        raise bad_request("prompt_logprobs: not available when stream is true", "prompt_logprobs")
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message: cannot be true together with add_generation_prompt (set "
                          "add_generation_prompt to false)", "continue_final_message")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo:  # vLLM: echo asks for the prompt's logprobs
        prompt_logprobs = body.top_logprobs or 0
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                             vocab_size=state.client.vocab_size)
    if tools.constraint is not None:  # a named function or "required": the output is held to the tools' schema
        if params.structured_outputs is not None:
            raise bad_request("tool_choice: you can only either use constraints for structured outputs or tools, "
                              "not both", "tool_choice")
        params = params.clone(structured_outputs=tools.constraint)
    engine_id = response_id = engine_id or request_id("chatcmpl", request, body.request_id)
    options = text_options(body, state.client.max_model_len, max_tokens,
                           continue_final_message=body.continue_final_message)
    template_kwargs = _template_kwargs(body, state, tools)
    prepared = await state.prepare_chat(engine_id, messages, params, body.add_generation_prompt,
                                        template_kwargs, options)
    reasoning = None
    if state.reasoning is not None:
        reasoning = state.reasoning.for_request(prepared.prompt_token_ids, template_kwargs)
        constraint = prepared.params.structured_outputs
        if constraint is not None and reasoning.grammar_start is not None:  # the grammar after the thinking
            later = msgspec.structs.replace(constraint, start_after=reasoning.grammar_start)
            prepared = dataclasses.replace(prepared, params=prepared.params.clone(structured_outputs=later))
    sticky = session_key(request, body.user)
    if sticky is not None:
        prepared = dataclasses.replace(prepared, session_key=sticky)
    role = "assistant" if body.add_generation_prompt else messages[-1]["role"]
    echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == role else ""
    as_ids = body.return_tokens_as_token_ids
    prompt_text = None
    if body.return_prompt_text:
        prompt_text = prepared.prompt if prepared.prompt is not None else (await state.prompt_texts([prepared]))[0]
    job = _Job(response_id, now(), model, body, prepared, role, echo,
               bool(as_ids if as_ids is not None else state.options.return_tokens_as_token_ids), prompt_text,
               state.options.prompt_tokens_details, tools.plan, reasoning)
    prepared = state.with_schedule([prepared], body, "chat")[0]
    return job, state.submit([prepared])


def _template_kwargs(body: ChatCompletionRequest, state: ServerState, tools: ToolRequest) -> dict[str, Any]:
    """What the chat template sees beyond the messages: chat_template_kwargs, documents,
    reasoning_effort (and enable_thinking from it, unless given: vLLM's rule) and a chat_template
    of the request's own (only with --trust-request-chat-template, as vLLM)."""
    kwargs = dict(body.chat_template_kwargs or {})
    if tools.template_tools is not None:
        kwargs["tools"] = tools.template_tools
    if body.documents is not None:
        kwargs.setdefault("documents", body.documents)
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        kwargs.setdefault("enable_thinking", body.reasoning_effort != "none")
    if body.chat_template is not None:
        if not state.options.trust_request_chat_template:
            raise bad_request("chat_template: a chat template in the request is refused unless the server runs "
                              "with --trust-request-chat-template", "chat_template")
        kwargs["chat_template"] = body.chat_template
    return kwargs


def _parse(plan: ToolPlan, parser: ToolParser, text: str, *, last: bool) -> ParsedDelta:
    """A choice's new text through its tool parser (``last``: the output ends here)."""
    parsed = parser.feed(text)
    if last:
        parsed.extend(parser.finish())
    parsed.calls = plan.keep(parsed.calls)
    return parsed


def _usage(job: _Job, output: RequestOutput) -> Usage:
    generated = sum(len(c.token_ids) for c in output.outputs)
    return usage(len(output.prompt_token_ids), generated, output.num_cached_tokens if job.details else None)


def _response(job: _Job, output: RequestOutput) -> ChatCompletionResponse:
    choices = []
    with_ids = bool(job.body.return_token_ids)
    for completion in output.outputs:
        logprobs = None
        if job.body.logprobs:
            logprobs = chat_logprobs(completion.token_ids, completion.logprobs or [], job.body.top_logprobs or 0,
                                     job.as_ids)
        reasoning, text = None, completion.text
        if job.reasoning is not None:
            reasoning, after = job.reasoning.split(completion.text)
            text = after or ""
            if not job.body.include_reasoning:
                reasoning = None
        message = AssistantMessage(role=job.role, content=job.echo + text, reasoning=reasoning)
        if job.reasoning is not None and not job.echo + text:
            message.content = None  # vLLM's: no content after the thinking
        finish_reason = completion.finish_reason
        if job.tools is not None:
            parsed = _parse(job.tools, job.tools.parser(), text, last=True)
            calls = merge_calls(parsed.calls)
            if job.tools.mode == "auto":
                content: str | None = (job.echo + parsed.content) or (None if calls else "")
            else:  # forced: content "" (vLLM's); output cut short (max_tokens) is not JSON, and no call
                calls = calls if _is_json(text) else []
                content = job.echo
            message = AssistantMessage(role=job.role, content=content, tool_calls=tool_calls_body(calls),
                                       reasoning=reasoning)
            finish_reason = job.tools.finish_reason(finish_reason, bool(calls))
        choices.append(ChatChoice(
            index=completion.index, message=message,
            logprobs=logprobs, finish_reason=finish_reason, stop_reason=completion.stop_reason,
            token_ids=list(completion.token_ids) if with_ids else None,
        ))
    return ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                                  usage=_usage(job, output),
                                  prompt_logprobs=prompt_logprobs_body(output.prompt_logprobs),
                                  prompt_token_ids=list(output.prompt_token_ids) if with_ids else None,
                                  prompt_text=job.prompt_text)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (ValueError, RecursionError):
        return False
    return True


async def _stream(job: _Job, stream: RequestStream,
                  error_of: Callable[[RequestOutput], OpenAIError]) -> AsyncIterator[bytes]:
    body = job.body
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    done: set[int] = set()
    last: RequestOutput | None = None
    parsers: dict[int, ToolParser] = {}
    thinking: dict[int, ReasoningStream] = {}
    called: set[int] = set()

    def chunk(choice: ChatStreamChoice, counts: dict[int, int] | None, first: bool = False) -> bytes:
        message = ChatCompletionChunk(id=job.response_id, created=job.created, model=job.model, choices=[choice])
        if first and body.return_token_ids:  # vLLM: the prompt's ids (and text) in the first chunk
            message.prompt_token_ids = list(job.prepared.prompt_token_ids)
        if first and job.prompt_text is not None:
            message.prompt_text = job.prompt_text
        if include_usage:  # OpenAI: null on every chunk but the last; vLLM's continuous stats: on each
            message.usage = None
            if continuous:  # vLLM: the prompt and this choice's tokens so far (none yet in the role and echo chunks)
                generated = counts.get(choice.index, 0) if counts is not None else 0
                message.usage = usage(len(job.prepared.prompt_token_ids), generated)
        return sse(message)

    for index in range(body.n):  # the role first, like OpenAI
        yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(role=job.role, content="")),
                    None, first=index == 0)
    if job.echo:
        for index in range(body.n):
            yield chunk(ChatStreamChoice(index=index, delta=DeltaMessage(content=job.echo)), None)
    error: OpenAIError | None = None
    async for _, output, step in merge_streams([stream]):  # a step at a time, however slowly the client reads
        last = output
        counts = {index: mark[1] for index, mark in step.items()}
        if output.error is not None and error is None:
            error = error_of(output)  # raised once every choice has streamed its end
        for completion in output.outputs:
            index = completion.index
            if index in done:
                continue
            text_end, end, finished = step[index]  # where this step left it (the lists grow since)
            delta = completion.text[sent_text.get(index, 0):text_end]
            first_token = sent_tokens.get(index, 0)
            new_ids = completion.token_ids[first_token:end]
            sent_text[index] = text_end
            sent_tokens[index] = end
            if not delta and not finished and not new_ids:
                continue  # nothing new for this choice in this step (vLLM: a token of no text gets its "" chunk)
            logprobs = None
            if body.logprobs and completion.logprobs is not None:
                logprobs = chat_logprobs(new_ids, completion.logprobs[first_token:end], body.top_logprobs or 0,
                                         job.as_ids)
            message = DeltaMessage(content=delta)
            shown = logprobs or (body.return_token_ids and new_ids)
            if job.reasoning is not None:
                thought, content = thinking.setdefault(index, job.reasoning.stream()).feed(delta, new_ids)
                if thought is None and content is None and not (finished or shown):
                    continue  # a step of tags only: no chunk (vLLM's)
                delta = content or ""
                message = DeltaMessage(content=content, reasoning=thought if body.include_reasoning else None)
            finish_reason = completion.finish_reason if finished else None
            if job.tools is not None:
                parser = parsers.setdefault(index, job.tools.parser())
                parsed = _parse(job.tools, parser, delta, last=finished)
                if parsed.calls:
                    called.add(index)
                if not (parsed.content or parsed.calls or finished or shown or message.reasoning):
                    continue  # held back: markup or whitespace the parser has not placed yet
                message = DeltaMessage(content=parsed.content or None, reasoning=message.reasoning,
                                       tool_calls=delta_tool_calls(parsed.calls) or None)
                finish_reason = job.tools.finish_reason(finish_reason, index in called)
            if finished:
                done.add(index)
            choice = ChatStreamChoice(index=index, delta=message, logprobs=logprobs,
                                      finish_reason=finish_reason,
                                      stop_reason=completion.stop_reason if finished else None)
            if body.return_token_ids:
                choice.token_ids = list(new_ids)
            yield chunk(choice, counts)
    if error is not None:  # the choices ended with finish_reason "error"; the error event says why
        raise error
    if include_usage and last is not None:
        yield sse(ChatCompletionChunk(id=job.response_id, created=job.created, model=job.model, choices=[],
                                      usage=_usage(job, last)))
    yield SSE_DONE
