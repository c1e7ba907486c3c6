"""What the completion and chat endpoints share before streaming: the server's state and options
(admission, tokenising off the loop, errors of a request), request ids and session keys, the
JSON body, and sampling parameters from the request's fields (streams: ``streaming.py``)."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import structlog
from starlette.requests import Request

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.frontend.text import PromptInput, TextOptions
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.protocol.errors import UNMEETABLE_DEADLINE
from vllm_actors.protocol.names import fit_request_id
from vllm_actors.protocol.sampling import MAX_LOGPROBS, SamplingParams
from vllm_actors.server.errors import (
    OpenAIError,
    bad_request,
    from_decode_error,
)
from vllm_actors.server.fields import check_media_type, lax_decode
from vllm_actors.server.limits import MAX_BODY_BYTES, RequestLimits
from vllm_actors.server.lora_routes import ServedAdapters
from vllm_actors.server.metrics import ServerMetrics
from vllm_actors.server.protocol import _SamplingFields
from vllm_actors.server.reasoning import ReasoningParser
from vllm_actors.server.sampling_checks import check_seed, logit_bias_of
from vllm_actors.server.streaming import abort_all
from vllm_actors.server.structured import structured_outputs_of
from vllm_actors.server.targets import Targets, with_schedule

log = structlog.get_logger(__name__)

DEFAULT_MAX_NUM_SEQS = 256  # the engine's default, when attached to a group of unknown config
DRAIN_BYTES = 64 * 1024 * 1024  # what is read and dropped past the cap before answering 413

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)


@dataclass(frozen=True)
class ServerOptions:
    """vLLM's server flags for the request fields: ``--max-logprobs`` (-1: the vocabulary),
    ``--return-tokens-as-token-ids``, ``--trust-request-chat-template``."""

    max_logprobs: int = MAX_LOGPROBS
    return_tokens_as_token_ids: bool = False
    trust_request_chat_template: bool = False
    prompt_tokens_details: bool = False  # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice: tool_choice "auto" (with a parser)
    tool_call_parser: str | None = None  # --tool-call-parser: "hermes"
    reasoning_parser: str | None = None  # --reasoning-parser: "qwen3" or "deepseek_r1"
    # --default-ttft-target-ms / --default-e2e-target-ms, and per endpoint --default-targets
    default_targets: Targets = field(default_factory=Targets)
    endpoint_targets: dict[str, Targets] = field(default_factory=dict)


@dataclass
class ServerState:
    client: AsyncEngineClient
    served_model_names: list[str]
    max_num_seqs: int
    max_waiting_requests: int | None
    metrics: ServerMetrics
    draining: bool = False
    limits: RequestLimits = field(default_factory=RequestLimits)
    options: ServerOptions = field(default_factory=lambda: ServerOptions())
    reasoning: ReasoningParser | None = None  # --reasoning-parser, over the model's tokenizer
    adapters: ServedAdapters | None = None  # LoRA adapters served by name (--enable-lora)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def max_in_flight(self) -> int | None:
        if self.max_waiting_requests is None:
            return None
        return self.max_num_seqs + self.max_waiting_requests

    def check_logprobs(self, name: str, value: int | None) -> None:
        """vLLM's bound: at most ``--max-logprobs`` (-1: the vocabulary) per position; -1 asks for
        the whole vocabulary."""
        if value is None:
            return
        if value < -1:
            raise bad_request(f"{name}: must be a non-negative value or -1, got {value}", name)
        vocab = self.client.frontend.vocab_size
        wanted = vocab if value == -1 else value
        cap = vocab if self.options.max_logprobs == -1 else self.options.max_logprobs
        if wanted > cap:
            raise bad_request(f"{name}: requested {wanted} logprobs, which is greater than max allowed: {cap} "
                              "(--max-logprobs)", name)

    def token_text(self, token_id: int, as_id: bool | None) -> str:
        """One token's text, or ``token_id:<id>`` with return_tokens_as_token_ids (the request's,
        else the server flag's)."""
        if as_id if as_id is not None else self.options.return_tokens_as_token_ids:
            return f"token_id:{token_id}"
        text = self.client.frontend.token_text(token_id)
        return text if text is not None else f"token_id:{token_id}"

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names:
            return self.model_name
        if self.adapters is not None and self.adapters.get(model) is not None:
            return model
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

    async def prepare(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                      text_options: TextOptions | None = None) -> PreparedRequest:
        """Tokenise (a long text off the event loop) and validate: the prompt within the byte limit
        and max_model_len, plus max_tokens within max_model_len; the frontend's ValueError is a 400
        naming the field it starts with."""
        with _bad_request_on_value_error():
            return await self.client.prepare_async(fit_request_id(request_id), prompt, params, max_tokens_must_fit=True,
                                                   max_prompt_bytes=self.limits.max_prompt_bytes,
                                                   text_options=text_options)

    async def prepare_chat(self, request_id: str, messages: list[dict[str, Any]], params: SamplingParams,
                           add_generation_prompt: bool,
                           chat_template_kwargs: dict[str, Any] | None,
                           text_options: TextOptions | None = None) -> PreparedRequest:
        """``prepare`` for a conversation, through the model's chat template."""
        with _bad_request_on_value_error():
            return await self.client.prepare_chat_async(
                fit_request_id(request_id), messages, params, add_generation_prompt=add_generation_prompt,
                chat_template_kwargs=chat_template_kwargs, max_tokens_must_fit=True,
                max_prompt_bytes=self.limits.max_prompt_bytes, text_options=text_options)

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
        if output.error is not None and output.error.startswith(UNMEETABLE_DEADLINE):
            return OpenAIError(output.error, 503)  # admission control (--reject-unmeetable)
        return OpenAIError(output.error or "the request failed", 400)

    def with_schedule(self, prepared: list[PreparedRequest], body: _SamplingFields,
                      endpoint: str) -> list[PreparedRequest]:
        """The body's priority and latency targets (else the server's defaults) on the requests, and
        the LoRA adapter its ``model`` names."""
        prepared = with_schedule(prepared, body, endpoint, self.options.endpoint_targets, self.options.default_targets)
        lora = self.adapters.get(getattr(body, "model", None)) if self.adapters is not None else None
        return [dataclasses.replace(p, lora_request=lora) for p in prepared] if lora is not None else prepared


@contextlib.contextmanager
def _bad_request_on_value_error() -> Iterator[None]:
    try:
        yield
    except ValueError as error:
        raise bad_request(str(error)) from None


MAX_SESSION_KEY_CHARS = 256


def session_key(request: Request, user: str | None) -> str | None:
    """The sticky-session key of a request in a replica set: the ``X-Session-Id`` header, else the
    body's ``user`` field (OpenAI's end-user id); None: no session. At most 256 characters."""
    key = request.headers.get("x-session-id") or user
    if key is not None and len(key) > MAX_SESSION_KEY_CHARS:
        raise bad_request(f"the session key (X-Session-Id, else user) must be at most {MAX_SESSION_KEY_CHARS} "
                          f"characters, got {len(key)}", param="user")
    return key or None


def request_id(prefix: str, request: Request, body_id: str | None = None) -> str:
    """``<prefix>-<X-Request-Id>`` when the client sends that header (it must then be unique among
    its requests in flight, as in vLLM), else ``<prefix>-<request_id>`` for the body's field, else
    ``<prefix>-<random>``: the response's ``id``, of any length or characters (vLLM's). The engine's
    request id (events, timelines) is the same when it is a valid one, else derived from it
    (``prepare``: ``names.fit_request_id``)."""
    header = request.headers.get("x-request-id") or body_id
    value = f"{prefix}-{header}" if header else f"{prefix}-{secrets.token_hex(16)}"
    request.state.request_id = value  # for the error lines at the edge (errors.edge_context)
    return value


async def decode_body(request: Request, kind: type[S], max_bytes: int = MAX_BODY_BYTES) -> S:
    """The JSON body as ``kind``; every failure is an OpenAIError: 413 past ``max_bytes`` (refused
    from Content-Length before reading, else once the bytes read pass it), 415 for a body declared
    as another media type, 400 for an empty body, malformed JSON, invalid UTF-8, too deep a nesting
    or a wrong field (after pydantic's lax coercions: ``fields.lax_decode``)."""
    body = await read_body(request, max_bytes)
    check_media_type(request.headers.get("content-type"))
    if not body:
        raise OpenAIError("the request body is empty; expected a JSON object", 400)
    try:
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError:  # a "true" for a bool, a "3" for an int: pydantic's lax mode, as vLLM
            return lax_decode(body, kind)
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
    vocab_size: int | None = None,
) -> SamplingParams:
    """OpenAI's and vLLM's request fields -> SamplingParams; invalid values are a 400 naming the field
    (``vocab_size``: logit_bias' ids are checked against it here, all of them named)."""
    check_seed(body.seed)
    logit_bias = logit_bias_of(body.logit_bias, vocab_size)
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
        "presence_penalty": 0.0 if body.presence_penalty is None else body.presence_penalty,
        "frequency_penalty": 0.0 if body.frequency_penalty is None else body.frequency_penalty,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": logit_bias,
        "allowed_token_ids": body.allowed_token_ids,
        "bad_words": list(body.bad_words or []),
        "structured_outputs": structured_outputs_of(body),
    }
    try:
        return SamplingParams(**fields)
    except ValueError as error:
        raise bad_request(str(error)) from None
