"""What the completion and chat endpoints share: the server's state, request checks, sampling
parameters, logprob formatting, Server-Sent Events, stream merging and disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import PositionLogprobs, RequestOutput
from vllm_actors.actors.frontend.text import PromptInput
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.server.errors import (
    OpenAIError,
    bad_request,
    edge_context,
    error_body,
    from_decode_error,
    log_edge_error,
    one_line,
)
from vllm_actors.server.limits import MAX_BODY_BYTES, RequestLimits
from vllm_actors.server.metrics import ServerMetrics
from vllm_actors.server.protocol import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob, _SamplingFields

log = structlog.get_logger(__name__)

DEFAULT_MAX_NUM_SEQS = 256  # the engine's default, when attached to a group of unknown config
DRAIN_BYTES = 64 * 1024 * 1024  # what is read and dropped past the cap before answering 413
LOGPROB_FLOOR = -9999.0  # what vLLM sends for -inf (JSON has no infinity)

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)


@dataclass
class ServerState:
    client: AsyncEngineClient
    served_model_names: list[str]
    max_num_seqs: int
    max_waiting_requests: int | None
    metrics: ServerMetrics
    draining: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_in_flight(self) -> int | None:
        if self.max_waiting_requests is None:
            return None
        return self.max_num_seqs + self.max_waiting_requests

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names:
            return self.model_name
        raise OpenAIError(f"The model `{model}` does not exist.", 404, param="model")

    def admit(self, num_engine_requests: int) -> None:
        """Refuse (503) once the engine has failed, and (503, Retry-After) while draining or when
        the queue is full. While an actor restarts, requests are taken: they wait, and are sent
        again as needed after a scheduler restart."""
        failure = self.client.failed
        if failure is not None:
            raise OpenAIError(f"The engine failed: {failure}", 503)
        if self.draining or self.client.is_closed:
            raise OpenAIError("The server is shutting down.", 503, headers={"Retry-After": "5"})
        limit = self.max_in_flight
        if limit is not None and num_engine_requests > limit:  # never admissible: not a 503 to retry
            raise bad_request(
                f"n: the request needs {num_engine_requests} sequences (n times the prompts), more than the "
                f"server takes at once ({limit})", "n")
        in_flight = self.client.num_unfinished
        if limit is not None and in_flight + num_engine_requests > limit:
            raise OpenAIError(
                f"The server is overloaded: {in_flight} requests in flight, at most {limit} "
                f"(max_num_seqs {self.max_num_seqs} + max_waiting_requests {self.max_waiting_requests}). "
                "Retry later.",
                503,
                headers={"Retry-After": "1"},
            )

    async def prepare(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> PreparedRequest:
        """Tokenise (a long text off the event loop) and validate: the prompt within the byte limit
        and max_model_len, plus max_tokens within max_model_len; the frontend's ValueError is a 400
        naming the field it starts with."""
        with _bad_request_on_value_error():
            return await self.client.prepare_async(request_id, prompt, params, max_tokens_must_fit=True,
                                                   max_prompt_bytes=self.limits.max_prompt_bytes)

    async def prepare_chat(self, request_id: str, messages: list[dict[str, Any]], params: SamplingParams,
                           add_generation_prompt: bool,
                           chat_template_kwargs: dict[str, Any] | None) -> PreparedRequest:
        """``prepare`` for a conversation, through the model's chat template."""
        with _bad_request_on_value_error():
            return await self.client.prepare_chat_async(
                request_id, messages, params, add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs, max_tokens_must_fit=True,
                max_prompt_bytes=self.limits.max_prompt_bytes)

    async def prompt_texts(self, prepared: Sequence[PreparedRequest]) -> list[str]:
        """Each prompt's text (for echo): as given, else decoded (a long one off the loop)."""
        return [p.prompt if p.prompt is not None else await self.client.detokenize_async(p.prompt_token_ids)
                for p in prepared]

    def submit(self, prepared: Sequence[PreparedRequest]) -> list[RequestStream]:
        """Admit, then send every request; if one fails, those already sent are aborted (reason
        "error") before the error goes on: a failed request leaves nothing in flight."""
        self.admit(sum(p.params.n for p in prepared))
        streams: list[RequestStream] = []
        try:
            for p in prepared:
                streams.append(self.client.submit(p))
        except BaseException:
            abort_all(streams, "error")
            raise
        return streams

    def output_error(self, output: RequestOutput) -> OpenAIError:
        """The error of a request that ended with one: the engine's failure is a 503 (the group gave
        up); anything else (the scheduler refused the request) a 400."""
        failure = self.client.failure
        if failure is not None:
            return OpenAIError(f"The engine failed: {failure}", 503)
        return OpenAIError(output.error or "the request failed", 400)


@contextlib.contextmanager
def _bad_request_on_value_error() -> Iterator[None]:
    try:
        yield
    except ValueError as error:
        raise bad_request(str(error)) from None


def request_id(prefix: str, request: Request) -> str:
    """``<prefix>-<X-Request-Id>`` when the client sends that header (it must then be unique among
    its requests in flight, as in vLLM), else ``<prefix>-<random>``. The response's ``id`` and the
    engine's request id (events, timelines) are the same."""
    header = request.headers.get("x-request-id")
    value = f"{prefix}-{header}" if header else f"{prefix}-{secrets.token_hex(16)}"
    request.state.request_id = value  # for the error lines at the edge (errors.edge_context)
    return value


async def decode_body(request: Request, kind: type[S], max_bytes: int = MAX_BODY_BYTES) -> S:
    """The JSON body as ``kind``; every failure is an OpenAIError: 413 past ``max_bytes`` (refused
    from Content-Length before reading, else once the bytes read pass it), 400 for an empty body,
    malformed JSON, invalid UTF-8, too deep a nesting or a wrong field."""
    body = await read_body(request, max_bytes)
    if not body:
        raise OpenAIError("the request body is empty; expected a JSON object", 400)
    try:
        return msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as error:
        raise from_decode_error(error, request.headers.get("content-type")) from None


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, kept only up to ``max_bytes``: past that (or a Content-Length past it) the rest
    is read and dropped, up to ``DRAIN_BYTES`` more, before the 413, so that the client, still
    sending, gets the answer rather than a reset connection."""
    declared = request.headers.get("content-length", "")
    size = 0
    chunks: list[bytes] | None = None if declared.isdigit() and int(declared) > max_bytes else []
    async for chunk in request.stream():
        size += len(chunk)
        if chunks is not None and size > max_bytes:
            chunks = None  # too large: drop what was kept
        if chunks is not None:
            chunks.append(chunk)
        elif size > max_bytes + DRAIN_BYTES:
            break
    if chunks is None:
        raise OpenAIError(f"the request body is larger than {max_bytes} bytes", 413)
    return b"".join(chunks)


def sampling_params(
    body: _SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    """OpenAI's and vLLM's request fields -> SamplingParams; invalid values are a 400 naming the field."""
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        value = getattr(body, name)
        if value is not None and value != neutral:
            raise bad_request(f"{name}: not supported by this engine (only {neutral} is accepted)", name)
    if body.logit_bias:
        raise bad_request("logit_bias: not supported by this engine", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed when stream is true", "stream_options")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    fields: dict[str, Any] = {
        "n": body.n,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": 0 if body.top_k is None else body.top_k,
        "min_p": 0.0 if body.min_p is None else body.min_p,
        "seed": body.seed,
        "max_tokens": max_tokens,
        "min_tokens": body.min_tokens,
        "stop": [body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        "stop_token_ids": list(body.stop_token_ids or []),
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "ignore_eos": body.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": body.skip_special_tokens,
    }
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        raise bad_request(str(error)) from None


# --------------------------------------------------------------------------- logprobs
def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _token_text(entry: Any, token_id: int) -> str:
    return entry.decoded_token if entry.decoded_token is not None else f"token_id:{token_id}"


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    text_offset: int,
    decode: Callable[[int], str],
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs for ``token_ids`` (a position without logprobs - the first prompt
    token - gets None). Returns them and the text offset after the last token."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position else None
        text = _token_text(chosen, token_id) if chosen is not None else decode(token_id)
        result.text_offset.append(text_offset)
        result.tokens.append(text)
        if chosen is None or position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            result.token_logprobs.append(_finite(chosen.logprob))
            result.top_logprobs.append({_token_text(e, i): _finite(e.logprob) for i, e in position.items()})
        text_offset += len(text)
    return result, text_offset


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top: int) -> ChatLogprobs:
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        if chosen is None:
            continue
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        tops = [
            TopLogprob(token=_token_text(e, i), logprob=_finite(e.logprob),
                       bytes=list(_token_text(e, i).encode("utf-8", errors="replace")))
            for i, e in ranked[:top]
        ]
        text = _token_text(chosen, token_id)
        content.append(TokenLogprob(token=text, logprob=_finite(chosen.logprob),
                                    bytes=list(text.encode("utf-8", errors="replace")), top_logprobs=tops))
    return ChatLogprobs(content=content)


# --------------------------------------------------------------------------- streams
async def final_output(stream: RequestStream) -> RequestOutput:
    last: RequestOutput | None = None
    async for output in stream:
        last = output
    if last is None:  # an iteration always ends with the finished output
        raise RuntimeError(f"request {stream.request_id} ended without output")
    return last


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several streams as they come."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as error:
            await queue.put((index, error))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
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
