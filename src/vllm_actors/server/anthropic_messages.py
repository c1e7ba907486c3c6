"""Anthropic's Messages API, as vLLM 0.26 serves it: ``POST /v1/messages`` (streamed or not) and
``POST /v1/messages/count_tokens``, served through the chat path (``chat.chat_completion``).

Errors come in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``, with the
status and the ``type`` vLLM gives (its OpenAI error types: ``BadRequestError``, ``NotFoundError``...;
``internal_error`` for an unexpected failure). The server's API key is also taken from the
``x-api-key`` header on these routes (``auth.py``): that is where Anthropic's clients send it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import msgspec
from fastapi import FastAPI
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.server.anthropic_convert import chat_request, message_body
from vllm_actors.server.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_error,
    anthropic_error_of,
)
from vllm_actors.server.anthropic_stream import anthropic_events
from vllm_actors.server.chat import chat_completion, conversation
from vllm_actors.server.errors import OpenAIError, log_edge_error
from vllm_actors.server.serving import ServerState, decode_body, request_id
from vllm_actors.server.streaming import EventStreamResponse
from vllm_actors.server.tools import plan_tools

MESSAGES_PATH = "/v1/messages"


def register_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    """Add ``/v1/messages`` and ``/v1/messages/count_tokens`` to ``app``."""

    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        return await _answer(request, lambda: create_message(request, state))

    @app.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await _answer(request, lambda: count_message_tokens(request, state))


async def _answer(request: Request, handle: Callable[[], Awaitable[Response]]) -> Response:
    """The handler's response; its errors in Anthropic's shape."""
    try:
        return await handle()
    except OpenAIError as error:
        return _json(anthropic_error_of(error), error.status, error.headers)
    except ClientDisconnect:
        raise
    except Exception as error:  # vLLM's route answers any failure as a 500 "internal_error"
        log_edge_error("request failed", request.scope, error)
        return _json(anthropic_error(f"internal server error: {type(error).__name__}", "internal_error"), 500)


def _json(body: dict[str, Any], status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, headers=headers, media_type="application/json")


async def create_message(request: Request, state: ServerState) -> Response:
    body = await decode_body(request, MessagesRequest, state.limits.max_body_bytes)
    body.check()
    response = await chat_completion(chat_request(body), request, state)
    if isinstance(response, EventStreamResponse):
        chat_events = cast(AsyncIterator[bytes], response.body_iterator)
        return EventStreamResponse(anthropic_events(chat_events, body.stop_sequences), response.streams)
    if response.status_code != 200:  # the client left (499): nobody reads the body
        return response
    return _json(message_body(json.loads(bytes(response.body)), body.stop_sequences))


async def count_message_tokens(request: Request, state: ServerState) -> Response:
    """The prompt's length, chat template and tools included (vLLM renders the chat request)."""
    body = await decode_body(request, CountTokensRequest, state.limits.max_body_bytes)
    body.check()
    state.check_model(body.model)
    chat = chat_request(body)
    tools = plan_tools(chat, auto_enabled=True)  # nothing is generated: only what the template sees counts
    kwargs = dict(chat.chat_template_kwargs or {})
    if tools.template_tools is not None:
        kwargs["tools"] = tools.template_tools
    prepared = await state.prepare_chat(request_id("count", request), conversation(chat.messages),
                                        SamplingParams(max_tokens=1), True, kwargs)
    tokens = len(prepared.prompt_token_ids)
    return _json({"input_tokens": tokens, "context_management": {"original_input_tokens": tokens}})
