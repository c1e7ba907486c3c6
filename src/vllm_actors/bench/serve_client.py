"""``vllm-actors bench serve``'s client: the synthetic requests, a streaming OpenAI-completions
client on plain asyncio sockets, the processes that send the load, and the statistics.

Standard library only, so that the same client drives any server (this engine's, vLLM's) from any
environment, and its cost per streamed chunk stays small (no HTTP library between the socket and
the clock).

Timing, per request (``time.monotonic``, one clock for every process of the machine):
- TTFT: request sent -> the first chunk carrying text (or token ids) arrives;
- inter-token latency (ITL): the gaps between consecutive such chunks (a chunk that carries several
  tokens counts as one gap, as in vLLM's own serving benchmark);
- end-to-end: request sent -> the stream ends.
Output tokens are the server's ``usage.completion_tokens`` (``stream_options.include_usage``), else
the number of chunks with text.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from vllm_actors.bench.report import percentile

# ShareGPT-like length mix: log-normal around a few hundred prompt tokens and ~200 output tokens,
# clipped to the ranges asked for.
INPUT_LEN_RANGE = (128, 1024)
OUTPUT_LEN_RANGE = (64, 512)
INPUT_LEN_MEDIAN, OUTPUT_LEN_MEDIAN, LEN_SIGMA = 320.0, 180.0, 0.6
TOKEN_ID_RANGE = (0, 9999)  # ordinary tokens of any large vocabulary (no special tokens)


# --------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class ServeRequest:
    index: int
    prompt: list[int]
    max_tokens: int
    offset: float = 0.0  # seconds after the load's start (Poisson arrivals); 0 for closed loops
    extra: dict[str, Any] | None = None  # more fields of the body (priority, targets: serve_mixed.py)


def _lognormal_len(rng: random.Random, median: float, bounds: tuple[int, int]) -> int:
    return int(min(max(round(rng.lognormvariate(math.log(median), LEN_SIGMA)), bounds[0]), bounds[1]))


def make_requests(
    count: int,
    seed: int,
    input_range: tuple[int, int] = INPUT_LEN_RANGE,
    output_range: tuple[int, int] = OUTPUT_LEN_RANGE,
    rate: float | None = None,
) -> list[ServeRequest]:
    """``count`` requests with random token-id prompts; with ``rate``, Poisson arrival offsets."""
    rng = random.Random(seed)
    in_median = min(max(INPUT_LEN_MEDIAN, input_range[0]), input_range[1])
    out_median = min(max(OUTPUT_LEN_MEDIAN, output_range[0]), output_range[1])
    requests, clock = [], 0.0
    for index in range(count):
        prompt = [rng.randint(*TOKEN_ID_RANGE) for _ in range(_lognormal_len(rng, in_median, input_range))]
        max_tokens = _lognormal_len(rng, out_median, output_range)
        if rate is not None:
            clock += rng.expovariate(rate)
        requests.append(ServeRequest(index, prompt, max_tokens, clock if rate is not None else 0.0))
    return requests


def poisson_requests(rate: float, duration: float, seed: int, **lengths: Any) -> list[ServeRequest]:
    """The requests of a Poisson process at ``rate`` per second that arrive within ``duration``."""
    expected = max(1, int(rate * duration * 1.5 + 20))
    drawn = make_requests(expected, seed, rate=rate, **lengths)
    while drawn[-1].offset <= duration:  # rare: the process ran ahead of 1.5x its mean
        expected *= 2
        drawn = make_requests(expected, seed, rate=rate, **lengths)
    return [request for request in drawn if request.offset <= duration] or drawn[:1]


# --------------------------------------------------------------------------- one streamed request
class HttpError(Exception):
    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        self.status = status


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readline()
            if not size_line:
                return
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            data = await reader.read(min(remaining, 1 << 16))
            if not data:
                return
            remaining -= len(data)
            yield data
    else:
        while data := await reader.read(1 << 16):
            yield data


async def sse_post(url: str, body: dict[str, Any]) -> AsyncIterator[tuple[float, str]]:
    """POSTs ``body`` as JSON and yields ``(arrival time, data)`` for each server-sent event's
    ``data:`` field, stamped when the network read that completed it returned."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
    try:
        writer.write(
            f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        status_line = await reader.readline()
        fields = status_line.split(None, 2)
        if len(fields) < 2:
            raise ConnectionError(f"bad status line {status_line!r}")
        status = int(fields[1])
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if status != 200:
            raise HttpError(status, b"".join([chunk async for chunk in _read_body(reader, headers)]))
        buffer = b""
        async for data in _read_body(reader, headers):
            now = time.monotonic()
            buffer = (buffer + data).replace(b"\r\n", b"\n")
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield now, line[5:].strip().decode()
    finally:
        writer.close()


@dataclass
class RequestResult:
    index: int
    prompt_len: int
    max_tokens: int
    start: float = 0.0  # monotonic
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    chunks: int = 0
    finish_reason: str = ""
    itl: list[float] = field(default_factory=list)

    def meets(self, ttft_slo: float, itl_slo: float) -> bool:
        """The SLO: TTFT within ``ttft_slo`` and this request's own p99 gap within ``itl_slo``."""
        if not self.ok or self.ttft > ttft_slo:
            return False
        return not self.itl or percentile(sorted(self.itl), 0.99) <= itl_slo


async def stream_one(url: str, model: str, request: ServeRequest, temperature: float, timeout: float) -> RequestResult:
    result = RequestResult(request.index, len(request.prompt), request.max_tokens)
    body = {
        "model": model, "prompt": request.prompt, "max_tokens": request.max_tokens, "temperature": temperature,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(request.extra or {}),
    }
    result.start = time.monotonic()
    finished = False

    async def consume() -> bool:
        last = 0.0
        async for arrived, data in sse_post(url, body):
            if data == "[DONE]":
                return True
            message = json.loads(data)
            if "error" in message:
                raise RuntimeError(f"error event: {message['error']}")
            usage = message.get("usage")
            if usage and usage.get("completion_tokens") is not None:
                result.output_tokens = int(usage["completion_tokens"])
            for choice in message.get("choices") or []:
                if choice.get("text") or choice.get("token_ids"):
                    if result.chunks == 0:
                        result.ttft = arrived - result.start
                    else:
                        result.itl.append(arrived - last)
                    last = arrived
                    result.chunks += 1
                if choice.get("finish_reason"):
                    result.finish_reason = str(choice["finish_reason"])
        return bool(result.finish_reason)

    try:
        finished = await asyncio.wait_for(consume(), timeout)
        result.e2e = time.monotonic() - result.start
        if result.output_tokens == 0:
            result.output_tokens = result.chunks
        result.ok = finished and result.chunks > 0
        if not result.ok:
            result.error = "stream ended without a finish" if result.chunks else "no tokens"
    except Exception as error:  # a failed request is a result, not the end of the benchmark
        result.e2e = time.monotonic() - result.start
        result.error = f"{type(error).__name__}: {error}"[:300]
    return result


# --------------------------------------------------------------------------- one client process
@dataclass(frozen=True)
class Shard:
    """One process's part of a load: Poisson requests at their offsets, or ``workers`` closed loops
    over ``requests`` until ``duration`` has passed."""

    url: str
    model: str
    requests: list[ServeRequest]
    temperature: float
    timeout: float
    workers: int = 0  # 0: open loop (each request at its offset)
    duration: float = 0.0


async def run_shard(shard: Shard, start_at: float) -> list[RequestResult]:
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    if shard.workers == 0:
        async def at_offset(request: ServeRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start_at + request.offset - time.monotonic()))
            return await stream_one(shard.url, shard.model, request, shard.temperature, shard.timeout)

        return list(await asyncio.gather(*(at_offset(request) for request in shard.requests)))

    results: list[RequestResult] = []
    queue = list(reversed(shard.requests))
    deadline = start_at + shard.duration

    async def worker() -> None:
        while queue and time.monotonic() < deadline:
            results.append(await stream_one(shard.url, shard.model, queue.pop(), shard.temperature, shard.timeout))

    await asyncio.gather(*(worker() for _ in range(shard.workers)))
    return results


def _client_process(shard: Shard, ready: Any, go: Any, start_at: Any, results: Any, slot: int) -> None:
    ready.put(slot)
    go.wait()
    try:
        results.put((slot, [asdict(result) for result in asyncio.run(run_shard(shard, start_at.value))]))
    except BaseException as error:
        results.put((slot, f"{type(error).__name__}: {error}"))


def run_load(
    shards: Sequence[Shard], *, in_process: bool = False, start_delay: float = 0.2
) -> tuple[list[RequestResult], float]:
    """Runs the shards, one process each (or in this process, for tests), started together;
    returns every request's result and the load's start (monotonic)."""
    if in_process:
        start = time.monotonic() + start_delay

        async def all_shards() -> list[list[RequestResult]]:
            return list(await asyncio.gather(*(run_shard(shard, start) for shard in shards)))

        flat = [result for part in asyncio.run(all_shards()) for result in part]
        return sorted(flat, key=lambda result: result.index), start
    context = multiprocessing.get_context("spawn")
    ready, results, go = context.Queue(), context.Queue(), context.Event()
    start_at = context.Value("d", 0.0)
    processes = [context.Process(target=_client_process, args=(shard, ready, go, start_at, results, slot),
                                 daemon=True) for slot, shard in enumerate(shards)]
    for process in processes:
        process.start()
    for _ in processes:
        ready.get(timeout=120)
    start_at.value = time.monotonic() + start_delay
    go.set()
    gathered: list[RequestResult] = []
    for _ in processes:
        slot, part = results.get()
        if isinstance(part, str):
            raise RuntimeError(f"client process {slot} failed: {part}")
        gathered.extend(RequestResult(**item) for item in part)
    for process in processes:
        process.join(timeout=30)
    return sorted(gathered, key=lambda result: result.index), start_at.value


def split_load(
    url: str, model: str, requests: Sequence[ServeRequest], processes: int, *, temperature: float, timeout: float,
    concurrency: int = 0, duration: float = 0.0,
) -> list[Shard]:
    """Requests dealt round-robin to ``processes`` shards; a closed loop's ``concurrency`` split
    as evenly as it goes (shards without workers are dropped)."""
    processes = max(1, min(processes, concurrency or processes, len(requests)))
    shards = []
    for slot in range(processes):
        workers = concurrency // processes + (1 if slot < concurrency % processes else 0) if concurrency else 0
        shards.append(Shard(url, model, list(requests[slot::processes]), temperature, timeout, workers, duration))
    return shards


# --------------------------------------------------------------------------- statistics
def spread(samples: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"count": len(ordered), "p50": percentile(ordered, 0.5), "p90": percentile(ordered, 0.9),
            "p99": percentile(ordered, 0.99), "mean": sum(ordered) / len(ordered) if ordered else 0.0,
            "max": ordered[-1] if ordered else 0.0}


def tpot(ttft: float, e2e: float, output_tokens: int) -> float | None:
    """Time per output token after the first, (e2e - ttft) / (tokens - 1): unlike the gaps between
    chunks, it does not depend on how many tokens the server puts in a chunk."""
    return (e2e - ttft) / (output_tokens - 1) if output_tokens > 1 else None


def summarize(results: Sequence[RequestResult], start: float, ttft_slo: float, itl_slo: float) -> dict[str, Any]:
    """The load's figures: seconds in the spreads; wall = first send to last end."""
    done = [result for result in results if result.ok]
    end = max((result.start + result.e2e for result in results), default=start)
    wall = max(end - start, 1e-9)
    good = sum(1 for result in results if result.meets(ttft_slo, itl_slo))
    errors: dict[str, int] = {}
    for result in results:
        if not result.ok:
            errors[result.error.split(":")[0]] = errors.get(result.error.split(":")[0], 0) + 1
    return {
        "requests": len(results), "completed": len(done), "failed": len(results) - len(done), "errors": errors,
        "wall_s": wall, "request_rate": len(done) / wall,
        "prompt_tokens": sum(result.prompt_len for result in done),
        "output_tokens": sum(result.output_tokens for result in done),
        "output_tok_s": sum(result.output_tokens for result in done) / wall,
        "ttft": spread([result.ttft for result in done]),
        "itl": spread([gap for result in done for gap in result.itl]),
        "tpot": spread([t for r in done if (t := tpot(r.ttft, r.e2e, r.output_tokens)) is not None]),
        "tokens_per_chunk": (sum(r.output_tokens for r in done) / max(1, sum(r.chunks for r in done))),
        "e2e": spread([result.e2e for result in done]),
        "goodput": {"ttft_slo_s": ttft_slo, "itl_p99_slo_s": itl_slo, "good": good,
                    "share": good / len(results) if results else 0.0, "rate": good / wall},
    }
