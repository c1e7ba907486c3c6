"""The prefix-caching benchmark's workloads (see ``vllm_actors.bench.prefix``): prompts of seeded
random token ids, and how each workload drives an ``AsyncEngineClient`` while timing every request
as its client sees it.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

if TYPE_CHECKING:
    from vllm_actors.clients.async_client import AsyncEngineClient

T = TypeVar("T")

# --------------------------------------------------------------------------- the workloads
WORKLOAD_NAMES = ("shared", "chat")
DEFAULT_SEED = 0
DEFAULT_MAX_TOKENS = 128
DEFAULT_NUM_REQUESTS = 256
DEFAULT_SYSTEM_TOKENS = 2000
SUFFIX_LEN_RANGE = (20, 100)  # tokens of its own after the shared system prompt (inclusive)
DEFAULT_CONVERSATIONS = 64
DEFAULT_CONCURRENCY = 16
DEFAULT_TURNS = 4
USER_LEN_RANGE = (50, 150)  # new user tokens per turn (inclusive)
TOKEN_ID_LIMIT = 10_000  # ids are drawn from [0, min(this, vocab size)): ordinary tokens of Qwen3's vocabulary


def _rng(seed: int, stream: str) -> random.Random:
    """One generator per purpose, so that changing one workload's size leaves the others' tokens alone."""
    return random.Random(f"bench-prefix/{stream}/{seed}")


def random_tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    limit = min(vocab_size, TOKEN_ID_LIMIT)
    return [rng.randrange(limit) for _ in range(count)]


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def _greedy(max_tokens: int) -> Any:
    from vllm_actors.protocol.sampling import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


@dataclass(frozen=True)
class RequestTiming:
    """One request as the client saw it; seconds since it was submitted."""

    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None  # None: no token came
    e2e_s: float
    finish_reason: str | None

    @property
    def completed(self) -> bool:
        return self.finish_reason in ("length", "stop")


async def timed_request(
    client: AsyncEngineClient, request_id: str, prompt: list[int], max_tokens: int
) -> tuple[RequestTiming, list[int]]:
    """Submit one token-id prompt and follow it to its end; returns its timing and generated ids."""
    submitted = time.perf_counter()
    first_token: float | None = None
    last = None
    async for output in client.generate({"prompt_token_ids": prompt}, _greedy(max_tokens), request_id):
        if first_token is None and output.outputs and output.outputs[0].token_ids:
            first_token = time.perf_counter()
        last = output
    ended = time.perf_counter()
    completion = last.outputs[0] if last is not None and last.outputs else None
    generated = list(completion.token_ids) if completion is not None else []
    timing = RequestTiming(
        prompt_tokens=len(prompt), output_tokens=len(generated),
        ttft_s=None if first_token is None else first_token - submitted, e2e_s=ended - submitted,
        finish_reason=None if completion is None else completion.finish_reason,
    )
    return timing, generated


async def gather_all(awaitables: Iterable[Awaitable[T]]) -> list[T]:
    """Every result, in order; the first failure cancels the others (and is raised once they are done)."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


class Workload(Protocol):
    name: ClassVar[str]

    @property
    def num_requests(self) -> int: ...

    @property
    def longest_sequence(self) -> int: ...  # prompt + output tokens of the longest request

    @property
    def warmup_prompt_tokens(self) -> int: ...  # a typical prompt length, for the warm-up

    def describe(self) -> dict[str, Any]: ...

    async def run(self, client: AsyncEngineClient) -> list[RequestTiming]: ...


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Requests sharing one system prompt, each with a suffix of its own, all submitted at once."""

    name: ClassVar[str] = "shared"
    system_prompt: list[int]
    suffixes: list[list[int]]
    max_tokens: int

    @property
    def prompts(self) -> list[list[int]]:
        return [self.system_prompt + suffix for suffix in self.suffixes]

    @property
    def num_requests(self) -> int:
        return len(self.suffixes)

    @property
    def longest_sequence(self) -> int:
        return len(self.system_prompt) + max(len(suffix) for suffix in self.suffixes) + self.max_tokens

    @property
    def warmup_prompt_tokens(self) -> int:
        return len(self.system_prompt) + SUFFIX_LEN_RANGE[1]

    def describe(self) -> dict[str, Any]:
        return {"num_requests": self.num_requests, "system_tokens": len(self.system_prompt),
                "suffix_len_range": list(SUFFIX_LEN_RANGE), "max_tokens": self.max_tokens,
                "prompt_tokens": sum(len(prompt) for prompt in self.prompts)}

    async def run(self, client: AsyncEngineClient) -> list[RequestTiming]:
        requests = (timed_request(client, f"shared-{index}", prompt, self.max_tokens)
                    for index, prompt in enumerate(self.prompts))
        return [timing for timing, _ in await gather_all(requests)]


def make_shared_workload(
    num_requests: int = DEFAULT_NUM_REQUESTS,
    system_tokens: int = DEFAULT_SYSTEM_TOKENS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    vocab_size: int = TOKEN_ID_LIMIT,
    seed: int = DEFAULT_SEED,
) -> SharedPrefixWorkload:
    _require_positive(num_requests=num_requests, system_tokens=system_tokens, max_tokens=max_tokens)
    rng = _rng(seed, "shared")
    system_prompt = random_tokens(rng, system_tokens, vocab_size)
    suffixes = [random_tokens(rng, rng.randint(*SUFFIX_LEN_RANGE), vocab_size) for _ in range(num_requests)]
    return SharedPrefixWorkload(system_prompt, suffixes, max_tokens)


@dataclass(frozen=True)
class ChatWorkload:
    """Multi-turn conversations, ``concurrency`` at a time; each turn resends the whole history."""

    name: ClassVar[str] = "chat"
    user_turns: list[list[list[int]]]  # per conversation, per turn: the new user tokens
    concurrency: int
    max_tokens: int

    @property
    def num_requests(self) -> int:
        return sum(len(turns) for turns in self.user_turns)

    @property
    def longest_sequence(self) -> int:
        return max(sum(len(user) + self.max_tokens for user in turns) for turns in self.user_turns)

    @property
    def warmup_prompt_tokens(self) -> int:
        return USER_LEN_RANGE[1]

    def describe(self) -> dict[str, Any]:
        return {"conversations": len(self.user_turns), "turns": len(self.user_turns[0]),
                "concurrency": self.concurrency, "user_len_range": list(USER_LEN_RANGE),
                "max_tokens": self.max_tokens, "num_requests": self.num_requests}

    async def run(self, client: AsyncEngineClient) -> list[RequestTiming]:
        slots = asyncio.Semaphore(self.concurrency)

        async def conversation(index: int, turns: list[list[int]]) -> list[RequestTiming]:
            async with slots:
                return await self._converse(client, index, turns)

        per_conversation = await gather_all(conversation(index, turns) for index, turns in enumerate(self.user_turns))
        return [timing for timings in per_conversation for timing in timings]

    async def _converse(self, client: AsyncEngineClient, index: int, turns: list[list[int]]) -> list[RequestTiming]:
        history: list[int] = []
        timings: list[RequestTiming] = []
        for turn, user in enumerate(turns):
            prompt = history + user
            timing, generated = await timed_request(client, f"chat-{index}-{turn}", prompt, self.max_tokens)
            timings.append(timing)
            history = prompt + generated
        return timings


def make_chat_workload(
    conversations: int = DEFAULT_CONVERSATIONS,
    turns: int = DEFAULT_TURNS,
    concurrency: int = DEFAULT_CONCURRENCY,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    vocab_size: int = TOKEN_ID_LIMIT,
    seed: int = DEFAULT_SEED,
) -> ChatWorkload:
    _require_positive(conversations=conversations, turns=turns, concurrency=concurrency, max_tokens=max_tokens)
    rng = _rng(seed, "chat")
    user_turns = [[random_tokens(rng, rng.randint(*USER_LEN_RANGE), vocab_size) for _ in range(turns)]
                  for _ in range(conversations)]
    return ChatWorkload(user_turns, concurrency, max_tokens)
