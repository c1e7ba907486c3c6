"""``vllm-actors bench prefix``: one run - a fresh engine, the warm-up, one workload timed, and the
metrics store's counters around it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import structlog

from vllm_actors.bench.prefix_workloads import RequestTiming, Workload, _rng, gather_all, random_tokens, timed_request
from vllm_actors.bench.report import LatencyStats

if TYPE_CHECKING:
    from vllm_actors.clients.async_client import AsyncEngineClient

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- the warm-up
DEFAULT_WARMUP_REQUESTS = 2
WARMUP_MAX_TOKENS = 16
WARMUP_EXTENSION = 32  # tokens each warm-up prompt adds to the previous one
WARMUP_BURST = 20  # concurrent warm-up requests after the sequential ones


# --------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class StoreCounters:
    """Cumulative counters of the metrics store (the whole process group)."""

    ended: int  # requests finished or aborted
    prefix_cache_queries: int | None  # None: the store does not report prefix caching
    prefix_cache_hits: int | None
    prefill_tokens: int  # prompt tokens computed, recomputation included
    preemptions: int
    steps: int = 0  # engine steps (STEP_FINISHED events)

    @classmethod
    def of(cls, reply: Any) -> StoreCounters:
        queries = getattr(reply, "prefix_cache_queries", None)
        hits = getattr(reply, "prefix_cache_hits", None)
        return cls(
            ended=reply.requests_finished + reply.requests_aborted,
            prefix_cache_queries=None if queries is None else int(queries),
            prefix_cache_hits=None if hits is None else int(hits),
            prefill_tokens=reply.prefill_tokens, preemptions=reply.preemptions, steps=reply.steps,
        )

    def since(self, before: StoreCounters) -> StoreCounters:
        """What happened between ``before`` and this reading."""

        def delta(after: int | None, earlier: int | None) -> int | None:
            return None if after is None or earlier is None else after - earlier

        return StoreCounters(
            ended=self.ended - before.ended,
            prefix_cache_queries=delta(self.prefix_cache_queries, before.prefix_cache_queries),
            prefix_cache_hits=delta(self.prefix_cache_hits, before.prefix_cache_hits),
            prefill_tokens=self.prefill_tokens - before.prefill_tokens,
            preemptions=self.preemptions - before.preemptions,
            steps=self.steps - before.steps,
        )


async def settled_counters(client: AsyncEngineClient, expected_ended: int, timeout_s: float = 30.0) -> StoreCounters:
    """The store's counters once it has seen ``expected_ended`` requests end and two readings in a
    row agree (events travel on their own bus, each actor's separately)."""
    deadline = time.monotonic() + timeout_s
    previous: StoreCounters | None = None
    while True:
        current = StoreCounters.of(await client.get_metrics())
        caught_up = current.ended >= expected_ended
        if caught_up and current == previous:
            return current
        if time.monotonic() > deadline:
            log.warning("the metrics store has not settled", ended=current.ended, expected=expected_ended)
            return current
        previous = current if caught_up else None
        await asyncio.sleep(0.1)


async def warm_up(client: AsyncEngineClient, prompt_tokens: int, count: int, vocab_size: int, seed: int) -> int:
    """``count`` requests of tokens unrelated to the workloads, one after the other, each prompt
    the previous one plus ``WARMUP_EXTENSION`` tokens (with caching on, the later ones reuse the
    earlier's blocks). Returns how many were sent."""
    if count <= 0:
        return 0
    room = client.max_model_len - WARMUP_MAX_TOKENS - WARMUP_EXTENSION * (count - 1)
    rng = _rng(seed, "warmup")
    prompt = random_tokens(rng, max(1, min(prompt_tokens, room)), vocab_size)
    started = time.perf_counter()
    for index in range(count):
        await timed_request(client, f"warmup-{index}", prompt, WARMUP_MAX_TOKENS)
        prompt = prompt + random_tokens(rng, WARMUP_EXTENSION, vocab_size)
    # Then a burst of concurrent requests over one prefix with tails of several lengths, so that
    # batched prefill (with and without cached context) and mixed steps have run before timing.
    burst = [prompt[: max(1, len(prompt) // 2)] + random_tokens(rng, 1 + 7 * index, vocab_size)
             for index in range(WARMUP_BURST)]
    await gather_all(timed_request(client, f"warmup-burst-{index}", tokens, WARMUP_MAX_TOKENS)
                     for index, tokens in enumerate(burst))
    log.info("warm-up done", requests=count + WARMUP_BURST, seconds=round(time.perf_counter() - started, 2))
    return count + WARMUP_BURST


@dataclass(frozen=True)
class RunResult:
    """One workload on one engine, prefix caching on or off."""

    workload: str
    prefix_caching: bool
    num_requests: int  # sent
    completed: int  # ended with finish reason "length" or "stop"
    prompt_tokens: int
    output_tokens: int
    seconds: float  # wall time from the first submission to the last request's end
    ttft: LatencyStats  # client side: submit to first token
    e2e: LatencyStats  # client side: submit to end
    prefix_cache_queries: int | None  # tokens looked up in the cache during the run (metrics store)
    prefix_cache_hits: int | None  # of which found
    prefill_tokens_computed: int  # prompt tokens the engine computed during the run (metrics store)
    preemptions: int
    steps: int = 0  # engine steps during the run
    ttft_samples: tuple[float, ...] = ()  # sorted, seconds: for the CDF

    @classmethod
    def of(cls, workload: str, prefix_caching: bool, timings: Sequence[RequestTiming], seconds: float,
           store: StoreCounters) -> RunResult:
        ttfts = sorted(timing.ttft_s for timing in timings if timing.ttft_s is not None)
        return cls(
            workload=workload, prefix_caching=prefix_caching, num_requests=len(timings),
            completed=sum(timing.completed for timing in timings),
            prompt_tokens=sum(timing.prompt_tokens for timing in timings),
            output_tokens=sum(timing.output_tokens for timing in timings), seconds=seconds,
            ttft=LatencyStats.of(ttfts), e2e=LatencyStats.of([timing.e2e_s for timing in timings]),
            prefix_cache_queries=store.prefix_cache_queries, prefix_cache_hits=store.prefix_cache_hits,
            prefill_tokens_computed=store.prefill_tokens, preemptions=store.preemptions, steps=store.steps,
            ttft_samples=tuple(ttfts),
        )

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def hit_rate(self) -> float | None:
        if self.prefix_cache_queries is None or self.prefix_cache_hits is None or self.prefix_cache_queries <= 0:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "output_tokens_per_s": self.output_tokens_per_s,
                "total_tokens_per_s": self.total_tokens_per_s, "hit_rate": self.hit_rate}


@dataclass(frozen=True)
class EngineOptions:
    model: str
    engine_args: dict[str, Any]
    check_invariants: bool = False


async def start_engine(options: EngineOptions, prefix_caching: bool) -> AsyncEngineClient:
    from vllm_actors.clients.async_client import AsyncEngineClient

    log.info("starting the engine", model=options.model, enable_prefix_caching=prefix_caching)
    started = time.perf_counter()
    client = await AsyncEngineClient.start(options.model, check_invariants=options.check_invariants,
                                           enable_prefix_caching=prefix_caching, **options.engine_args)
    log.info("engine ready", seconds=round(time.perf_counter() - started, 1))
    return client


def check_fits(workload: Workload, max_model_len: int) -> None:
    if workload.longest_sequence > max_model_len:
        raise ValueError(f"the {workload.name} workload needs {workload.longest_sequence} tokens of context "
                         f"(prompt + output) but max_model_len is {max_model_len}: raise --max-model-len or "
                         "shrink the workload")


async def measure_run(
    options: EngineOptions, workload: Workload, prefix_caching: bool, warmup_requests: int, seed: int
) -> RunResult:
    """A fresh engine: the warm-up, then the workload, timed; the engine is stopped on the way out."""
    client = await start_engine(options, prefix_caching)
    async with client:
        check_fits(workload, client.max_model_len)
        sent = await warm_up(client, workload.warmup_prompt_tokens, warmup_requests, client.vocab_size, seed)
        before = await settled_counters(client, sent)
        log.info("timed run", workload=workload.name, enable_prefix_caching=prefix_caching,
                 requests=workload.num_requests)
        started = time.perf_counter()
        timings = await workload.run(client)
        seconds = time.perf_counter() - started
        after = await settled_counters(client, sent + len(timings))
    result = RunResult.of(workload.name, prefix_caching, timings, seconds, after.since(before))
    log.info("timed run done", workload=workload.name, enable_prefix_caching=prefix_caching,
             seconds=round(seconds, 3), output_tok_s=round(result.output_tokens_per_s, 1),
             ttft_p50_ms=round(result.ttft.p50 * 1e3, 1), hit_rate=result.hit_rate)
    return result
