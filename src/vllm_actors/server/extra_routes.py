"""vLLM's endpoints beyond completions and chat, registered on the app by ``add_extra_routes``:
``/tokenize``, ``/detokenize``, the two ``/render`` endpoints (``tokenize.py``), the batch of
conversations ``POST /v1/chat/completions/batch``, SageMaker's ``POST /invocations`` and
``GET|POST /ping``, and the development endpoints (``dev_routes.py``) where enabled."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import msgspec
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from vllm_actors.server.chat import create_chat_completion
from vllm_actors.server.completions import create_completion
from vllm_actors.server.dev_routes import add_dev_routes
from vllm_actors.server.errors import OpenAIError, bad_request
from vllm_actors.server.protocol import encode, now
from vllm_actors.server.serving import ServerState, read_body
from vllm_actors.server.tokenize import detokenize, render_chat, render_completion, tokenize

Handler = Any  # async (Request, ServerState) -> Response


def add_extra_routes(app: FastAPI, state: ServerState, health: Handler) -> None:
    """Register the endpoints above on ``app``; ``health`` is the app's ``/health`` handler
    (``/ping`` answers as it does)."""

    def route(path: str, handler: Handler, methods: tuple[str, ...] = ("POST",)) -> None:
        async def endpoint(request: Request) -> Response:
            return await handler(request, state)  # type: ignore[no-any-return]

        app.add_api_route(path, endpoint, methods=list(methods), name=handler.__name__)

    route("/tokenize", tokenize)
    route("/detokenize", detokenize)
    route("/v1/completions/render", render_completion)
    route("/v1/chat/completions/render", render_chat)
    route("/v1/chat/completions/batch", batch_chat_completion)
    route("/invocations", invocations)

    async def ping(request: Request) -> Response:
        return await health()  # type: ignore[no-any-return]

    app.add_api_route("/ping", ping, methods=["GET"], name="ping")
    app.add_api_route("/ping", ping, methods=["POST"], name="ping_post")  # one operation id per method
    add_dev_routes(app, state)


# ------------------------------------------------------------------ the body, read once and routed
async def _json_object(request: Request, state: ServerState) -> tuple[bytes, dict[str, Any]]:
    raw = await read_body(request, state.limits.max_body_bytes)
    try:
        body = msgspec.json.decode(raw) if raw else None
    except msgspec.DecodeError as error:
        raise OpenAIError(f"JSON decode error: {error}", 400) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return raw, body


def _sub_request(request: Request, body: bytes, drop_request_id: bool = False) -> Request:
    """A request like ``request`` (path, headers, client) whose body is ``body``."""
    headers = [(name, value) for name, value in request.scope.get("headers", [])
               if name != b"content-length" and not (drop_request_id and name == b"x-request-id")]
    headers.append((b"content-length", str(len(body)).encode()))
    scope = dict(request.scope, headers=headers)
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return await request.receive()  # the client's disconnect, when it comes
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


async def invocations(request: Request, state: ServerState) -> Response:
    """SageMaker's entry point: a chat body (``messages``) goes to chat completions, a completion
    body (``prompt``) to completions, as vLLM routes by which request type the body validates as."""
    raw, body = await _json_object(request, state)
    if "messages" in body:
        return await create_chat_completion(_sub_request(request, raw), state)
    if "prompt" in body:
        return await create_completion(_sub_request(request, raw), state)
    raise bad_request("Cannot find suitable handler for request. Expected one of: "
                      "['CompletionRequest', 'ChatCompletionRequest']")


async def batch_chat_completion(request: Request, state: ServerState) -> Response:
    """vLLM's ``/v1/chat/completions/batch``: ``messages`` is a list of conversations, the other
    fields are chat's and apply to each; one response whose choice ``i`` answers conversation ``i``
    (usage summed). Not streamed, no tools (vLLM's limits)."""
    _, body = await _json_object(request, state)
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations \
            or not all(isinstance(c, list) for c in conversations):
        raise bad_request("messages: a batch takes a non-empty list of conversations (each a list of messages)",
                          "messages")
    if body.get("stream"):
        raise bad_request("stream: streaming is not supported for batch chat completions", "stream")
    if body.get("tools"):
        raise bad_request("tools: tool use is not supported for batch chat completions", "tools")
    if body.get("n", 1) not in (1, None):
        raise bad_request("n: batch chat completions return one choice per conversation (n must be 1)", "n")
    base = request.headers.get("x-request-id") or body.get("request_id") or secrets.token_hex(16)
    tasks = [asyncio.ensure_future(create_chat_completion(
        _sub_request(request, encode(dict(body, messages=messages, request_id=f"{base}_{i}")), drop_request_id=True),
        state)) for i, messages in enumerate(conversations)]
    try:
        replies = await asyncio.gather(*tasks)
    except BaseException:  # the first error ends the batch: the other conversations' requests are aborted
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    choices: list[dict[str, Any]] = []
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    first: dict[str, Any] = {}
    for index, reply in enumerate(replies):
        if reply.status_code != 200:
            return reply  # the client went away (499)
        answer = msgspec.json.decode(bytes(reply.body))
        first = first or answer
        for choice in answer["choices"]:
            choices.append(dict(choice, index=index))
        for key in totals:
            totals[key] += answer["usage"][key]
    merged = dict(first, id=f"chatcmpl-{base}", created=now(), choices=choices, usage=totals)
    return Response(encode(merged), media_type="application/json")
