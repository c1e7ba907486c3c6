"""The OpenAI Responses API as vLLM serves it for a text model: ``POST /v1/responses`` (streamed or
not, in the background or not), ``GET /v1/responses/{id}`` (``stream=true``: a background stream's
events replayed, ``responses_background``) and ``POST /v1/responses/{id}/cancel``.

A request becomes a chat completion request (``responses_protocol``), runs through the chat path
(``chat.start_chat``: templates, tools, structured outputs, sampling), and its chat result becomes
output items (``responses_items.output_items``) or streaming events (``responses_stream``).
Responses are stored by default (``store``) in a bounded store (``responses_store``), which
``previous_response_id`` continues from."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog
from fastapi import FastAPI, Request
from starlette.responses import Response

from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.envs import envs
from vllm_actors.server.chat import _Job, _response, _stream, chat_output, start_chat
from vllm_actors.server.errors import OpenAIError, bad_request, log_edge_error
from vllm_actors.server.protocol import encode, now
from vllm_actors.server.responses_background import (
    Event,
    EventLog,
    check_starting_after,
    log_events,
    unknown_events,
)
from vllm_actors.server.responses_items import (
    Shell,
    new_id,
    output_items,
    response_logprobs,
    status_of,
    usage_body,
)
from vllm_actors.server.responses_protocol import ResponsesRequest, chat_request, check_request, input_messages
from vllm_actors.server.responses_store import ResponseStore, Stored, history_after
from vllm_actors.server.responses_stream import ResponseEvents, sse_event
from vllm_actors.server.serving import ServerState, decode_body
from vllm_actors.server.streaming import SSE_DONE, EventStreamResponse, abort_all, final_output

log = structlog.get_logger(__name__)

_NO_STORE = ("This server keeps no responses (VLLM_ACTORS_RESPONSES_STORE_SIZE=0) and therefore does not support "
             "the background mode")


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """The Responses API's three routes on ``app``, with a store of their own."""
    store = ResponseStore(envs.VLLM_ACTORS_RESPONSES_STORE_SIZE)
    app.state.responses = store

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        return await create_response(request, state, store)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False, starting_after: int | None = None) -> Response:
        check_starting_after(starting_after)
        stored = _stored(store, response_id)
        if not stream:
            return _json(stored.response)
        if stored.events is None:
            raise unknown_events(response_id)
        return EventStreamResponse(_sse(stored.events.replay(starting_after)))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        return _json(await cancel_response(store, response_id))


def _json(body: dict[str, Any]) -> Response:
    return Response(encode(body), media_type="application/json")


def _stored(store: ResponseStore, response_id: str) -> Stored:
    stored = store.get(response_id)
    if stored is None:
        raise OpenAIError(f"Response with id '{response_id}' not found.", 404, param="response_id")
    return stored


async def create_response(request: Request, state: ServerState, store: ResponseStore) -> Response:
    body = await decode_body(request, ResponsesRequest, state.limits.max_body_bytes)
    check_request(body)
    if body.background and not store.enabled:
        raise bad_request(_NO_STORE, "background")
    history = _stored(store, body.previous_response_id).history if body.previous_response_id is not None else []
    messages = [*history, *input_messages(body.input)]
    prompt = [{"role": "system", "content": body.instructions}, *messages] if body.instructions else messages
    auto = state.options.enable_auto_tool_choice and state.options.tool_call_parser is not None
    response_id = body.request_id or new_id("resp")
    request.state.request_id = response_id  # for the error lines at the edge
    job, streams = await start_chat(request, state, chat_request(body, prompt, auto_tools=auto), engine_id=response_id)
    params = job.prepared.params
    shell = Shell(response_id, now(), job.model, body, params.temperature, params.top_p, params.max_tokens)
    keep = store if body.store and store.enabled else None
    if body.background:
        assert keep is not None
        stored = Stored(shell.response("queued"), messages, streams=streams)
        store.put(response_id, stored)
        if body.stream:  # the events are kept for this request and any later GET ?stream=true
            stored.events = EventLog()
            work = log_events(_events(job, shell, streams[0], state, store, messages), stored.events, response_id)
        else:
            work = _background(job, shell, streams[0], state, store, messages)
        stored.task = asyncio.create_task(work)
        store.tasks.add(stored.task)
        stored.task.add_done_callback(store.tasks.discard)
        return EventStreamResponse(_sse(stored.events.replay())) if stored.events else _json(stored.response)
    if body.stream:
        return EventStreamResponse(_sse(_events(job, shell, streams[0], state, keep, messages)), streams)
    output = await chat_output(request, state, streams)
    if output is None:
        return Response(status_code=499)
    response = finished_response(job, shell, output)
    if keep is not None:
        keep.put(response_id, Stored(response, history_after(messages, response["output"])))
    return _json(response)


def finished_response(job: _Job, shell: Shell, output: RequestOutput) -> dict[str, Any]:
    """The response to a finished request: the chat endpoint's answer, as output items."""
    chat = msgspec.to_builtins(_response(job, output))
    choice = chat["choices"][0]
    items = output_items(choice["message"], response_logprobs(choice.get("logprobs")))
    return shell.response(status_of(choice["finish_reason"]), items, usage_body(chat["usage"]))


async def _sse(events: AsyncIterator[Event]) -> AsyncIterator[bytes]:
    async for event in events:
        yield sse_event(event)


async def _events(job: _Job, shell: Shell, stream: RequestStream, state: ServerState, store: ResponseStore | None,
                  messages: list[dict[str, Any]]) -> AsyncIterator[Event]:
    """The response's events, from the chat stream's chunks; a failure is an ``error`` event (and
    a background response's stored status "failed")."""
    builder = ResponseEvents(shell)
    try:
        for event in builder.start():
            yield event
        if shell.body.background:
            store_status(store, shell.response_id, shell.response("in_progress"))
        try:
            async for chunk in _stream(job, stream, state.output_error):
                if chunk != SSE_DONE:
                    for event in builder.feed(msgspec.json.decode(chunk.removeprefix(b"data: "))):
                        yield event
        except OpenAIError as error:
            log.warning("response stream ended with an error", request_id=shell.response_id, status=error.status)
            if shell.body.background and store is not None:
                failed = shell.response("failed", error={"code": str(error.status), "message": error.message})
                store.put(shell.response_id, Stored(failed, messages))
            for event in builder.fail(error):
                yield event
            return
        events, response = builder.finish()
        if store is not None:
            store.put(shell.response_id, Stored(response, history_after(messages, response["output"])))
        for event in events:
            yield event
    finally:
        stream.abort("abort")


def store_status(store: ResponseStore | None, response_id: str, response: dict[str, Any]) -> None:
    """A running background response's stored state, unless cancelled (or dropped) meanwhile."""
    stored = store.get(response_id) if store is not None else None
    if stored is not None and stored.response["status"] != "cancelled":
        stored.response = response


async def _background(job: _Job, shell: Shell, stream: RequestStream, state: ServerState, store: ResponseStore,
                      messages: list[dict[str, Any]]) -> None:
    """A background response: "in_progress" until its request ends, then stored as it ended."""
    store_status(store, shell.response_id, shell.response("in_progress"))
    try:
        output = await final_output(stream)
        if output.error is not None:
            error = state.output_error(output)
            response = shell.response("failed", error={"code": str(error.status), "message": error.message})
        else:
            response = finished_response(job, shell, output)
    except asyncio.CancelledError:
        stream.abort("abort")
        raise
    except Exception as error:  # the task has nobody to answer: the stored response says it failed
        log_edge_error("background response failed", {"path": "/v1/responses"}, error)
        response = shell.response("failed", error={"code": "500", "message": f"{type(error).__name__}"})
    store.put(shell.response_id, Stored(response, history_after(messages, response["output"])))


async def cancel_response(store: ResponseStore, response_id: str) -> dict[str, Any]:
    """vLLM's cancel: a queued or running background response becomes "cancelled" and its request
    is aborted; any other response is a 400."""
    stored = _stored(store, response_id)
    if stored.response["status"] not in ("queued", "in_progress"):
        raise bad_request("Cannot cancel a synchronous response.", "response_id")
    stored.response = dict(stored.response, status="cancelled")
    abort_all(stored.streams, "abort")
    if stored.task is not None:
        stored.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stored.task
    return stored.response
