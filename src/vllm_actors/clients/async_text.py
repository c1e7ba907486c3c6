"""The asyncio client's text work off the event loop: tokenising prompts, rendering chat
templates and detokenising long token lists on a small thread pool.

HF tokenizers' batch encoding releases the GIL while it works (``Tokenizer.encode`` uses it for long
texts), so a thread pool keeps the loop free: a process pool would have to ship the tokenizer and
the text across. Short texts stay on the loop, where they take microseconds.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from vllm_actors.actors.frontend.frontend import Frontend, PreparedRequest
from vllm_actors.actors.frontend.text import ChatMessages, PromptInput, TextOptions, tokenize_chat, tokenize_prompt
from vllm_actors.protocol.sampling import SamplingParams

T = TypeVar("T")

TEXT_WORKERS = 2  # threads for long texts: bounds how much tokenising (and its memory) runs at once
OFF_LOOP_CHARS = 16384  # shorter texts (or token lists) are handled on the loop
TEXT_NICENESS = 10  # the text threads yield the CPU to the event loop and the engine's processes


class TextPool:
    """Runs text work of a given size on the loop (small) or on the pool's threads (large)."""

    def __init__(self, name: str, workers: int = TEXT_WORKERS) -> None:
        self._name = name
        self._workers = workers
        self._pool: ThreadPoolExecutor | None = None

    async def run(self, work: Callable[[], T], size: int) -> T:
        if size < OFF_LOOP_CHARS:
            return work()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=f"{self._name}-text",
                                            initializer=_lower_priority)
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """Run this thread (and the tokenizer's own threads it starts) at a lower priority: a long
    prompt's tokenising then takes the CPU only when the loop, the bus and the metrics store (on
    which ``/health`` waits) do not need it. Linux niceness is per thread; elsewhere a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TEXT_NICENESS)
    except (AttributeError, OSError):
        pass


async def prepare_prompt(
    frontend: Frontend, pool: TextPool, request_id: str, prompt: PromptInput, params: SamplingParams, *,
    max_tokens_must_fit: bool, max_prompt_bytes: int | None, text_options: TextOptions | None = None,
) -> PreparedRequest:
    options = text_options or TextOptions()
    tokenize = functools.partial(tokenize_prompt, frontend.tokenizer, prompt, max_bytes=max_prompt_bytes,
                                 max_tokens=options.token_limit(frontend.max_model_len),
                                 add_special_tokens=options.add_special_tokens)
    text, ids = await pool.run(tokenize, prompt_size(prompt))
    text, ids = options.truncate(text, ids)
    return frontend.prepare_tokens(request_id, text, ids, params, max_tokens_must_fit=max_tokens_must_fit)


async def prepare_chat(
    frontend: Frontend, pool: TextPool, request_id: str, messages: ChatMessages, params: SamplingParams, *,
    add_generation_prompt: bool, chat_template_kwargs: Mapping[str, Any] | None, max_tokens_must_fit: bool,
    max_prompt_bytes: int | None, text_options: TextOptions | None = None,
) -> PreparedRequest:
    options = text_options or TextOptions(add_special_tokens=False)
    tokenize = functools.partial(tokenize_chat, frontend.tokenizer, messages,
                                 add_generation_prompt=add_generation_prompt,
                                 chat_template_kwargs=chat_template_kwargs, max_bytes=max_prompt_bytes,
                                 max_tokens=options.token_limit(frontend.max_model_len),
                                 continue_final_message=options.continue_final_message,
                                 add_special_tokens=options.add_special_tokens)
    size = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    text, ids = await pool.run(tokenize, size)
    truncated, ids = options.truncate(text, ids)
    return frontend.prepare_tokens(request_id, truncated, ids, params, field="messages",
                                   max_tokens_must_fit=max_tokens_must_fit)


async def detokenize(frontend: Frontend, pool: TextPool, token_ids: list[int]) -> str:
    tokenizer = frontend.tokenizer
    if tokenizer is None:
        return ""
    return await pool.run(functools.partial(tokenizer.decode, token_ids, skip_special_tokens=False), len(token_ids))


def prompt_size(prompt: PromptInput) -> int:
    """A prompt's text length (a token-id list: how many ids)."""
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, Mapping):
        value = prompt.get("prompt_token_ids", prompt.get("prompt"))
        return len(value) if isinstance(value, (str, list)) else 0
    return 0
