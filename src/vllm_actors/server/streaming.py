"""Streaming responses: a request's outputs read to the end or merged over several streams,
Server-Sent Events with the disconnect watched, and the aborts when a client leaves."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.request_stream import RequestStream, StepMark
from vllm_actors.server.errors import OpenAIError, edge_context, error_body, log_edge_error, one_line

log = structlog.get_logger(__name__)

T = TypeVar("T")


async def final_output(stream: RequestStream) -> RequestOutput:
    last: RequestOutput | None = None
    async for output in stream:
        last = output
    if last is None:  # an iteration always ends with the finished output
        raise RuntimeError(f"request {stream.request_id} ended without output")
    return last


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput, StepMark]]:
    """(stream index, output, one step's mark) from several streams as they come: an output that
    came after others its consumer had not taken yet comes once per output it stands for, with
    each one's ``StepMark``, so that a streamed response sends a chunk per engine step however
    slowly its client reads."""
    if len(streams) == 1:
        stream = streams[0]
        async for output in stream:
            for mark in stream.steps:
                yield 0, output, mark
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None, list[StepMark]]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output, stream.steps))
        except Exception as error:
            await queue.put((index, error, []))
        await queue.put((index, None, []))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item, marks = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                for mark in marks:
                    yield index, item, mark
    finally:
        for task in tasks:
            task.cancel()


def abort_all(streams: Sequence[RequestStream], reason: str) -> None:
    for stream in streams:
        stream.abort(reason)


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, streams: Sequence[RequestStream],
                              work: Callable[[], Awaitable[T]]) -> T:
    """Run ``work`` while watching the connection; a client that leaves aborts ``streams``
    (reason "disconnect") and raises ClientDisconnected."""
    task = asyncio.ensure_future(work())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        abort_all(streams, "disconnect")
        raise ClientDisconnected()
    except asyncio.CancelledError:
        task.cancel()
        abort_all(streams, "disconnect")
        raise
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


def sse(body: msgspec.Struct | dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def guarded_events(events: AsyncIterator[bytes], streams: Sequence[RequestStream],
                         request: Request) -> AsyncIterator[bytes]:
    """The SSE body: aborts the streams when the client leaves (the iteration is cancelled or
    closed early) and turns a failure into an error event, then ``[DONE]``, like vLLM. A failure
    is logged as one line naming the request (the traceback at debug level only)."""
    reason = "disconnect"
    try:
        async for chunk in events:
            yield chunk
        reason = "abort"
    except Exception as error:  # the stream has started: errors go in-band
        reason = "error"
        if isinstance(error, OpenAIError):
            log.warning("stream ended with an error", **edge_context(request.scope), status=error.status,
                        error=one_line(error.message))
        else:
            log_edge_error("stream failed", request.scope, error)
        status = error.status if isinstance(error, OpenAIError) else 500
        yield sse(error_body(str(error) or type(error).__name__, status))
        yield SSE_DONE
    finally:
        abort_all(streams, reason)


class EventStreamResponse(StreamingResponse):
    """Server-Sent Events, with the disconnect watched while streaming under any ASGI server, so
    that a client that leaves between two tokens aborts its request at once."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], streams: Sequence[RequestStream] = ()) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.streams = streams  # aborted at the end, should the body never have started

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if streamer.done():
                streamer.result()
        except OSError:
            pass  # the connection went away under us
        finally:
            for task in (streamer, watcher):
                if not task.done():
                    task.cancel()
            for task in (streamer, watcher):
                try:
                    await task
                except (asyncio.CancelledError, OSError, Exception):
                    pass
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                await closer()
            # A body generator closed before its first step never runs its own clean-up (a client
            # that left before the first byte): whatever is still running is aborted here.
            abort_all(self.streams, "disconnect")
