"""``vllm-actors bench serve --workload mixed``: interactive and batch requests in one bursty
arrival stream, and their SLO attainment. Pure: requests in, figures out (no sockets, no clocks).

Arrivals: an on/off modulated Poisson process. Time alternates between ``burst_on_s`` seconds at
``burst_factor`` times the mean rate and ``burst_off_s`` seconds at the rate that keeps the mean
at ``rate`` (so ``burst_factor * on / (on + off)`` must stay within 1). Each arrival is
interactive with probability ``interactive_share``, else batch; each class draws its own prompt
and output lengths (log-normal around the middle of its range, clipped).

Each class has targets (milliseconds; None: none): TTFT, each request's p99 inter-token gap, and
end-to-end. A request meets them when it completed and is within every one. The requests carry
``priority`` and ``ttft_target_ms`` / ``e2e_target_ms`` (relative to arrival) in their HTTP body
where set: an interactive request's end-to-end target is its TTFT target plus ``max_tokens`` gaps
at its inter-token target, unless one is given.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.bench.report import percentile
from vllm_actors.bench.serve_client import LEN_SIGMA, TOKEN_ID_RANGE, RequestResult, ServeRequest, spread

REJECTED_STATUS = 503  # admission control's answer to a deadline it cannot meet


@dataclass(frozen=True)
class RequestClass:
    name: str
    input_range: tuple[int, int]
    output_range: tuple[int, int]
    ttft_ms: float | None = None
    itl_ms: float | None = None  # bound on each request's p99 inter-token gap (judged, not sent)
    e2e_ms: float | None = None
    priority: int | None = None  # vLLM's field: lower runs first

    def e2e_target_ms(self, max_tokens: int) -> float | None:
        if self.e2e_ms is not None:
            return self.e2e_ms
        if self.ttft_ms is not None and self.itl_ms is not None:
            return self.ttft_ms + max_tokens * self.itl_ms
        return None


INTERACTIVE = RequestClass("interactive", (32, 256), (16, 128), ttft_ms=200.0, itl_ms=50.0, priority=0)
BATCH = RequestClass("batch", (1024, 2048), (256, 1024), ttft_ms=10_000.0, e2e_ms=120_000.0, priority=1)


@dataclass(frozen=True)
class MixedWorkload:
    rate: float  # mean arrivals per second
    duration: float  # seconds of arrivals
    seed: int
    interactive_share: float = 0.8
    burst_factor: float = 3.0  # arrival rate during a burst, times the mean
    burst_on_s: float = 2.0
    burst_off_s: float = 6.0
    classes: tuple[RequestClass, RequestClass] = (INTERACTIVE, BATCH)
    send_fields: bool = True  # priority and targets in the body (False: for servers without them)

    def rates(self) -> tuple[float, float]:
        """(rate during a burst, rate between bursts)."""
        period = self.burst_on_s + self.burst_off_s
        on_share = self.burst_on_s / period if period > 0 else 0.0
        if self.burst_factor * on_share > 1.0 + 1e-9 or self.burst_factor < 1.0:
            raise ValueError(f"burst factor {self.burst_factor} with {self.burst_on_s} s on in {period} s "
                             "cannot keep the mean rate (factor x on share must be at most 1)")
        off = (1.0 - self.burst_factor * on_share) / (1.0 - on_share) if on_share < 1.0 else 0.0
        return self.rate * self.burst_factor, self.rate * off

    def in_burst(self, offset: float) -> bool:
        period = self.burst_on_s + self.burst_off_s
        return period > 0 and offset % period < self.burst_on_s


@dataclass(frozen=True)
class MixedRequest(ServeRequest):
    klass: str = ""
    burst: bool = False  # arrived during a burst


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    median = math.sqrt(bounds[0] * bounds[1])
    return int(min(max(round(rng.lognormvariate(math.log(median), LEN_SIGMA)), bounds[0]), bounds[1]))


def arrival_offsets(workload: MixedWorkload, rng: random.Random) -> list[float]:
    """The on/off modulated Poisson arrivals within ``duration`` (memoryless: each segment draws
    afresh from its start)."""
    on_rate, off_rate = workload.rates()
    offsets: list[float] = []
    segment = 0.0
    while segment < workload.duration:
        burst = workload.in_burst(segment)
        length = workload.burst_on_s if burst else workload.burst_off_s
        if length <= 0:
            length = workload.duration
        end = min(segment + length, workload.duration)
        rate = on_rate if burst else off_rate
        clock = segment
        while rate > 0:
            clock += rng.expovariate(rate)
            if clock > end:
                break
            offsets.append(clock)
        segment = end
    return offsets


def mixed_requests(workload: MixedWorkload) -> list[MixedRequest]:
    """The workload's requests in arrival order, deterministic given its seed."""
    rng = random.Random(workload.seed)
    offsets = arrival_offsets(workload, rng)
    interactive, batch = workload.classes
    requests: list[MixedRequest] = []
    for index, offset in enumerate(offsets):
        klass = interactive if rng.random() < workload.interactive_share else batch
        prompt = [rng.randint(*TOKEN_ID_RANGE) for _ in range(_length(rng, klass.input_range))]
        max_tokens = _length(rng, klass.output_range)
        body: dict[str, Any] = {}
        if workload.send_fields:
            if klass.priority is not None:
                body["priority"] = klass.priority
            if klass.ttft_ms is not None:
                body["ttft_target_ms"] = klass.ttft_ms
            e2e = klass.e2e_target_ms(max_tokens)
            if e2e is not None:
                body["e2e_target_ms"] = e2e
        requests.append(MixedRequest(index, prompt, max_tokens, offset, extra=body, klass=klass.name,
                                     burst=workload.in_burst(offset)))
    return requests


# --------------------------------------------------------------------------- attainment
def meets(result: RequestResult, klass: RequestClass, max_tokens: int) -> bool:
    """Completed, and within every target of its class."""
    if not result.ok:
        return False
    if klass.ttft_ms is not None and result.ttft * 1e3 > klass.ttft_ms:
        return False
    if klass.itl_ms is not None and result.itl and percentile(sorted(result.itl), 0.99) * 1e3 > klass.itl_ms:
        return False
    e2e = klass.e2e_target_ms(max_tokens)
    return e2e is None or result.e2e * 1e3 <= e2e


def rejected(result: RequestResult) -> bool:
    return not result.ok and result.error.startswith(f"HttpError: HTTP {REJECTED_STATUS}")


@dataclass
class ClassFigures:
    requests: int = 0
    completed: int = 0
    rejected: int = 0
    met: int = 0
    output_tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl_p99: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)

    def as_dict(self, wall: float) -> dict[str, Any]:
        return {
            "requests": self.requests, "completed": self.completed, "rejected": self.rejected,
            "failed": self.requests - self.completed - self.rejected, "met": self.met,
            "attainment": self.met / self.requests if self.requests else 0.0,
            "output_tokens": self.output_tokens, "output_tok_s": self.output_tokens / wall,
            "ttft": spread(self.ttft), "itl_p99": spread(self.itl_p99), "e2e": spread(self.e2e),
        }


def attainment(results: Sequence[RequestResult], requests: Sequence[MixedRequest],
               classes: Sequence[RequestClass], start: float) -> dict[str, Any]:
    """Per class (and for the requests that arrived in a burst): requests, completed, rejected
    (HTTP 503), met, attainment (met / requests), output tokens and their rate over the load's wall
    time (first send to last end), TTFT / per-request p99 gap / end-to-end spreads in seconds."""
    by_index = {request.index: request for request in requests}
    by_name = {klass.name: klass for klass in classes}
    figures = {klass.name: ClassFigures() for klass in classes}
    burst = {klass.name: ClassFigures() for klass in classes}
    end = max((result.start + result.e2e for result in results), default=start)
    wall = max(end - start, 1e-9)
    for result in results:
        request = by_index[result.index]
        klass = by_name[request.klass]
        met = meets(result, klass, request.max_tokens)
        for table in (figures, burst) if request.burst else (figures,):
            entry = table[klass.name]
            entry.requests += 1
            entry.met += met
            entry.rejected += rejected(result)
            if result.ok:
                entry.completed += 1
                entry.output_tokens += result.output_tokens
                entry.ttft.append(result.ttft)
                entry.e2e.append(result.e2e)
                if result.itl:
                    entry.itl_p99.append(percentile(sorted(result.itl), 0.99))
    return {
        "wall_s": wall,
        "classes": {name: entry.as_dict(wall) for name, entry in figures.items()},
        "in_bursts": {name: entry.as_dict(wall) for name, entry in burst.items()},
        "targets": {klass.name: {"ttft_ms": klass.ttft_ms, "itl_p99_ms": klass.itl_ms, "e2e_ms": klass.e2e_ms,
                                 "priority": klass.priority} for klass in classes},
    }
