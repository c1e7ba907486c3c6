"""The asyncio client's request calls: prepare off the loop, submit, generate, abort. Each submitted
request's outputs arrive on its ``RequestStream``; ``AsyncEngineClient`` holds the reader that feeds
them."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.frontend.text import ChatMessages, PromptInput, TextOptions
from vllm_actors.clients import async_text
from vllm_actors.clients.core import ClientCore
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from vllm_actors.clients.latency import LatencyTracker
    from vllm_actors.clients.open_streams import OpenStreams


class AsyncRequests(ClientCore):
    """The request half of ``AsyncEngineClient``."""

    if TYPE_CHECKING:  # provided by AsyncEngineClient
        latency: LatencyTracker
        _streams: OpenStreams
        _text: async_text.TextPool
        _closed: bool

        def _check_alive(self) -> None: ...

        def _ensure_tasks(self) -> None: ...

    def submit(self, prepared: PreparedRequest) -> RequestStream:
        """Send a prepared request to the scheduler; its outputs arrive on the returned stream."""
        self._check_alive()
        self._ensure_tasks()
        stream = RequestStream(self, prepared, on_wait=self.latency.on_stream_wait)
        self._submit(prepared)
        self._streams.open(stream, time.monotonic())
        return stream

    async def prepare_async(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                            max_tokens_must_fit: bool = False, max_prompt_bytes: int | None = None,
                            text_options: TextOptions | None = None) -> PreparedRequest:
        """``prepare`` that keeps the loop free: a long text is tokenised on a worker thread
        (``clients/async_text.py``); a text over ``max_prompt_bytes`` is refused before tokenising,
        a token-id list over max_model_len before it is converted."""
        return await async_text.prepare_prompt(self.frontend, self._text, request_id, prompt, params,
                                               max_tokens_must_fit=max_tokens_must_fit,
                                               max_prompt_bytes=max_prompt_bytes, text_options=text_options)

    async def prepare_chat_async(self, request_id: str, messages: ChatMessages, params: SamplingParams, *,
                                 add_generation_prompt: bool = True,
                                 chat_template_kwargs: Mapping[str, Any] | None = None,
                                 max_tokens_must_fit: bool = False,
                                 max_prompt_bytes: int | None = None,
                                 text_options: TextOptions | None = None) -> PreparedRequest:
        """``prepare_chat`` that keeps the loop free (the template and tokenising of a long chat on a
        worker thread)."""
        return await async_text.prepare_chat(self.frontend, self._text, request_id, messages, params,
                                             add_generation_prompt=add_generation_prompt,
                                             chat_template_kwargs=chat_template_kwargs,
                                             max_tokens_must_fit=max_tokens_must_fit,
                                             max_prompt_bytes=max_prompt_bytes, text_options=text_options)

    async def detokenize_async(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens spelled out; a long list decoded off the loop."""
        return await async_text.detokenize(self.frontend, self._text, token_ids)

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> RequestStream:
        return self.submit(self.prepare(request_id, prompt, params))

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cancel_reason: str = "abort",
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request, the last one finished. Leaving the iteration early
        (break, cancellation, a closed generator) aborts the request with ``cancel_reason``."""
        stream = self.add_request(request_id or secrets.token_hex(8), prompt, sampling_params or SamplingParams())
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort(cancel_reason)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort a request of this client: the scheduler drops it (ABORTED(reason) on the bus) and
        its KV blocks are freed with the next plan. Unknown or finished ids are ignored."""
        stream = self._streams.close(request_id)
        if self._closed:
            return
        self._abort(request_id, reason)
        if stream is not None:
            stream._aborted()
