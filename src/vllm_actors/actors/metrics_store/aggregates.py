"""Running aggregates: counters, latency samples (count, mean, max, windowed percentiles) and the
KV-cache pools behind the KV gauges."""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from vllm_actors.protocol.events import KvPool
from vllm_actors.protocol.metrics import BucketCounts, Percentiles, SpecDecodeCounts


class Samples:
    """Count, mean and max of every value; percentiles over the last ``window`` values (linear
    interpolation, as ``numpy.percentile``'s default), cached until the next value."""

    __slots__ = ("_cached", "_window", "count", "max", "total")

    def __init__(self, window: int) -> None:
        self._window: deque[float] = deque(maxlen=window)
        self._cached: Percentiles | None = Percentiles()
        self.count = 0
        self.total = 0.0
        self.max = 0.0

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self._window.append(value)
        self.total += value
        self.max = value if self.count == 0 else max(self.max, value)
        self.count += 1
        self._cached = None

    def extend(self, values: Iterable[float]) -> None:
        finite = [value for value in values if math.isfinite(value)]
        if not finite:
            return
        self._window.extend(finite)
        self.total += sum(finite)
        self.max = max(finite) if self.count == 0 else max(self.max, max(finite))
        self.count += len(finite)
        self._cached = None

    def percentiles(self) -> Percentiles:
        if self._cached is None:
            ordered = sorted(self._window)
            self._cached = Percentiles(
                count=self.count, mean=self.total / self.count, p50=_quantile(ordered, 0.50),
                p90=_quantile(ordered, 0.90), p99=_quantile(ordered, 0.99), max=self.max,
            )
        return self._cached


def _quantile(ordered: list[float], q: float) -> float:
    """The q-quantile of sorted values, interpolating linearly between the two nearest ranks."""
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


class Buckets:
    """Counts of every value by fixed upper bounds (a Prometheus histogram's buckets)."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.count = 0
        self.total = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value

    def snapshot(self) -> BucketCounts:
        return BucketCounts(bounds=list(self.bounds), counts=list(self.counts), count=self.count, total=self.total)


class Latencies:
    """The latency sample windows a summary reports."""

    __slots__ = ("e2e", "itl", "queue", "restart", "step_ms", "ttft")

    def __init__(self, window: int) -> None:
        self.restart = Samples(window)
        self.ttft = Samples(window)
        self.itl = Samples(window)
        self.e2e = Samples(window)
        self.queue = Samples(window)
        self.step_ms = Samples(window)


class Counters(msgspec.Struct, kw_only=True):
    requests_arrived: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    finished_by_reason: dict[str, int] = {}
    aborted_by_reason: dict[str, int] = {}
    requests_interrupted: int = 0  # waiting or running when their scheduler restarted
    requests_lost: int = 0  # ended with an error, never finished: interrupted then failed, or open at a group failure
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    prefill_chunks: int = 0
    steps: int = 0
    step_tokens: int = 0
    drained_steps: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_evicted: int = 0
    kv_blocks_offloaded: int = 0
    kv_blocks_restored: int = 0
    spec_decode: SpecDecodeCounts = msgspec.field(default_factory=SpecDecodeCounts)
    rejected_batches: int = 0
    rejected_events: int = 0
    actor_failures: dict[str, int] = {}
    actor_restarts: dict[str, int] = {}
    pipeline_resets: int = 0
    group_failed: str | None = None


# --------------------------------------------------------------------------- KV cache
MAX_TRACKED_HOLDERS = 65_536  # requests whose blocks a pool follows (from ALLOCATED / FREED)

@dataclass(slots=True)
class KvPoolState:
    """One KV-cache actor's pool: its latest KV_POOL state, and the blocks it handed out per
    request from its ALLOCATED / FREED events (the fallback when no state was seen)."""

    blocks: dict[str, int] = field(default_factory=dict)
    in_use: int = 0
    free: int | None = None  # num_free_blocks of its latest event
    state: KvPool | None = None

    def allocated(self, request_id: str, count: int, num_free_blocks: int) -> None:
        self.blocks[request_id] = self.blocks.get(request_id, 0) + count
        self.in_use += count
        self.free = max(num_free_blocks, 0)
        if len(self.blocks) > MAX_TRACKED_HOLDERS:  # FREED events lost: forget the oldest holder
            self.in_use -= self.blocks.pop(next(iter(self.blocks)))

    def freed(self, request_id: str, num_blocks: int, num_free_blocks: int) -> None:
        held = self.blocks.get(request_id, 0)
        count = min(max(num_blocks, 0), held)  # never below what we saw allocated
        if count >= held:
            self.blocks.pop(request_id, None)
        else:
            self.blocks[request_id] = held - count
        self.in_use -= count
        self.free = max(num_free_blocks, 0)


@dataclass(frozen=True, slots=True)
class KvGauges:
    in_use: int = 0
    total: int = 0
    cached: int = 0

    @property
    def usage(self) -> float:
        return self.in_use / self.total if self.total else 0.0


def kv_gauges(pools: Iterable[KvPoolState]) -> KvGauges:
    """The KV gauges over every pool: its KV_POOL state where seen, else its ALLOCATED / FREED."""
    in_use = total = cached = 0
    for pool in pools:
        if pool.state is not None:
            in_use += pool.state.num_in_use
            total += pool.state.num_blocks
            cached += pool.state.num_cached
        else:
            in_use += pool.in_use
            total += max(pool.in_use + (pool.free or 0), pool.in_use)
    return KvGauges(in_use=in_use, total=total, cached=cached)
