"""vLLM's text endpoints that run nothing on the model: ``POST /tokenize`` and ``/detokenize``, and
``POST /v1/completions/render`` and ``/v1/chat/completions/render`` (what the engine would run:
vLLM's ``GenerateRequest`` shape, one per prompt for completions)."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.text import tokenize_chat, tokenize_prompt
from vllm_actors.server.chat import _template_kwargs, conversation
from vllm_actors.server.errors import OpenAIError, bad_request
from vllm_actors.server.fields import text_options
from vllm_actors.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    PromptShapeError,
    encode,
    normalize_prompts,
)
from vllm_actors.server.serving import ServerState, decode_body, request_id, sampling_params
from vllm_actors.server.tools import plan_tools

OFF_LOOP_CHARS = 16 * 1024  # a longer text is tokenised on a worker thread


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest | TokenizeChatRequest: ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


async def _off_loop(size: int, work: Any, *args: Any, **kwargs: Any) -> Any:
    if size < OFF_LOOP_CHARS:
        return work(*args, **kwargs)
    return await asyncio.to_thread(work, *args, **kwargs)


def _value_error(error: ValueError) -> OpenAIError:
    return bad_request(str(error))


async def tokenize(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, TokenizeRequest, state.limits.max_body_bytes)
    state.check_model(body.model)
    tokenizer = state.client.frontend.tokenizer
    max_bytes = state.limits.max_prompt_bytes
    try:
        if body.messages is not None:
            if body.prompt is not None:
                raise bad_request("give either prompt or messages, not both", "prompt")
            if body.continue_final_message and body.add_generation_prompt:
                raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                  "continue_final_message")
            kwargs = dict(body.chat_template_kwargs or {})
            if body.tools is not None:
                kwargs["tools"] = body.tools
            if body.chat_template is not None:
                if not state.options.trust_request_chat_template:
                    raise bad_request("chat_template: a chat template in the request is refused unless the server "
                                      "runs with --trust-request-chat-template", "chat_template")
                kwargs["chat_template"] = body.chat_template
            messages = conversation(body.messages)
            size = sum(len(m["content"]) for m in messages)
            _, ids = await _off_loop(size, tokenize_chat, tokenizer, messages,
                                     add_generation_prompt=body.add_generation_prompt, chat_template_kwargs=kwargs,
                                     max_bytes=max_bytes, continue_final_message=body.continue_final_message,
                                     add_special_tokens=bool(body.add_special_tokens))
        elif body.prompt is not None:
            special = True if body.add_special_tokens is None else body.add_special_tokens
            _, ids = await _off_loop(len(body.prompt), tokenize_prompt, tokenizer, body.prompt, max_bytes=max_bytes,
                                     add_special_tokens=special)
        else:
            raise bad_request("prompt or messages: one of them is required", "prompt")
    except ValueError as error:
        raise _value_error(error) from None
    strs = None
    if body.return_token_strs:
        pieces = tokenizer.convert_ids_to_tokens(ids) if tokenizer is not None else []
        strs = [piece if piece is not None else "" for piece in pieces]
    reply = TokenizeResponse(count=len(ids), max_model_len=state.client.max_model_len, tokens=ids, token_strs=strs)
    return Response(encode(reply), media_type="application/json")


async def detokenize(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, DetokenizeRequest, state.limits.max_body_bytes)
    state.check_model(body.model)
    vocab = state.client.frontend.vocab_size
    for token in body.tokens:
        if token < 0:
            raise bad_request(f"tokens: each token id must be >= 0, got {token}", "tokens")
        if token >= vocab:
            raise bad_request(f"Token id {token} is out of vocabulary", "tokens")
    text = await state.client.detokenize_async(body.tokens)
    return Response(encode({"prompt": text}), media_type="application/json")


# ------------------------------------------------------------------ render
def generate_request(prepared: PreparedRequest, model: str, body: Any) -> dict[str, Any]:
    """vLLM's GenerateRequest: the token ids and sampling parameters the engine would run."""
    return {
        "request_id": prepared.request_id,
        "token_ids": list(prepared.prompt_token_ids),
        "features": None,
        "sampling_params": msgspec.to_builtins(prepared.params),
        "model": model,
        "stream": bool(body.stream),
        "stream_options": msgspec.to_builtins(body.stream_options) if body.stream_options is not None else None,
        "cache_salt": body.cache_salt,
        "priority": body.priority,
        "kv_transfer_params": body.kv_transfer_params,
    }


async def render_completion(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, CompletionRequest, state.limits.max_body_bytes)
    model = state.check_model(body.model)
    try:
        prompts = normalize_prompts(body.prompt, max_tokens=state.client.max_model_len)
    except PromptShapeError as error:
        raise bad_request(str(error), "prompt") from None
    state.check_logprobs("logprobs", body.logprobs)
    params = sampling_params(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                             prompt_logprobs=body.prompt_logprobs)
    base = request_id("cmpl", request, body.request_id)
    options = text_options(body, state.client.max_model_len, body.max_tokens)
    rendered = []
    for index, prompt in enumerate(prompts):
        one = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        engine_id = base if len(prompts) == 1 else f"{base}-{index}"
        prepared = await state.prepare(engine_id, one, params, options)
        rendered.append(generate_request(prepared, model, body))
    return Response(msgspec.json.encode(rendered), media_type="application/json")


async def render_chat(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, ChatCompletionRequest, state.limits.max_body_bytes)
    model = state.check_model(body.model)
    messages = conversation(body.messages)
    tools = plan_tools(body, auto_enabled=state.options.enable_auto_tool_choice
                       and state.options.tool_call_parser is not None)
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request("continue_final_message: cannot be true together with add_generation_prompt (set "
                          "add_generation_prompt to false)", "continue_final_message")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = sampling_params(body, max_tokens=max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                             prompt_logprobs=body.prompt_logprobs)
    if tools.constraint is not None and params.structured_outputs is None:
        params = params.clone(structured_outputs=tools.constraint)
    engine_id = request_id("chatcmpl", request, body.request_id or secrets.token_hex(16))
    options = text_options(body, state.client.max_model_len, max_tokens,
                           continue_final_message=body.continue_final_message)
    prepared = await state.prepare_chat(engine_id, messages, params, body.add_generation_prompt,
                                        _template_kwargs(body, state, tools), options)
    return Response(encode(generate_request(prepared, model, body)), media_type="application/json")
