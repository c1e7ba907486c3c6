"""``vllm-actors bench throughput``: what the metrics store's event log says about a run (worker
steps, GPU idle share between decode steps, TTFT and ITL)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec

from vllm_actors.bench.report import IdleShare, LatencyStats


def read_event_log(path: Path) -> list[dict[str, Any]]:
    """The metrics store's dump: one flat dict per event (actor, seq, mono, wall, type, fields)."""
    decoder = msgspec.json.Decoder()
    with path.open("rb") as handle:
        return [decoder.decode(line) for line in handle if line.strip()]


def worker_steps(records: Iterable[dict[str, Any]], since_wall: float | None = None) -> list[dict[str, Any]]:
    """STEP_FINISHED events of the workers (from ``since_wall`` on), by actor then step id."""
    steps = [
        record for record in records
        if record.get("type") == "STEP_FINISHED" and str(record.get("actor", "")).startswith("worker")
        and (since_wall is None or record["wall"] >= since_wall)
    ]
    return sorted(steps, key=lambda record: (record["actor"], record["step_id"]))


def is_decode_only(step: dict[str, Any]) -> bool:
    return step["num_seqs"] > 0 and step["num_tokens"] == step["num_seqs"]


def _consecutive(steps: Sequence[dict[str, Any]]) -> Iterable[tuple[dict[str, Any], dict[str, Any]]]:
    for previous, current in itertools.pairwise(steps):
        if previous["actor"] == current["actor"] and current["step_id"] == previous["step_id"] + 1:
            yield previous, current


def decode_idle_share(steps: Sequence[dict[str, Any]]) -> IdleShare | None:
    """GPU idle share between consecutive decode-only steps: Σ max(0, Δmono of their STEP_FINISHED
    - execute_ms of the later step) / Σ Δmono. ``steps`` as ``worker_steps`` returns them."""
    idle = interval = 0.0
    pairs = 0
    for previous, current in _consecutive(steps):
        if not (is_decode_only(previous) and is_decode_only(current)):
            continue
        elapsed = current["mono"] - previous["mono"]
        if elapsed < 0:
            continue
        idle += max(0.0, elapsed - current["execute_ms"] / 1e3)
        interval += elapsed
        pairs += 1
    if pairs == 0:
        return None
    return IdleShare(share=idle / interval if interval > 0 else 0.0, idle_s=idle, interval_s=interval, pairs=pairs)


def gpu_busy_shares(records: Iterable[dict[str, Any]], since_wall: float | None = None) -> dict[str, float]:
    """Per worker whose every step was timed on the GPU (STEP_TIMED for each STEP_FINISHED: a pipeline
    stage's), the share of its window, from its first timed step's start to its last one's end on the
    device clock, that its GPU spent in steps. Host times say nothing of a stage's GPU: its steps are
    read back long after, or never waited for."""
    finished: dict[str, int] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for record in records:
        actor = str(record.get("actor", ""))
        if not actor.startswith("worker") or (since_wall is not None and record["wall"] < since_wall):
            continue
        if record.get("type") == "STEP_FINISHED":
            finished[actor] = finished.get(actor, 0) + 1
        elif record.get("type") == "STEP_TIMED":
            spans.setdefault(actor, []).append((record["gpu_start"], record["gpu_end"]))
    shares: dict[str, float] = {}
    for actor, intervals in sorted(spans.items()):
        if len(intervals) < finished.get(actor, 0):
            continue  # some steps were timed on the host: no device-clock window to speak of
        intervals.sort()
        busy, end = 0.0, float("-inf")
        for start, stop in intervals:  # the union: a step starts after the one before it ends
            busy += max(0.0, stop - max(start, end))
            end = max(end, stop)
        window = end - intervals[0][0]
        if window > 0:
            shares[actor] = busy / window
    return shares


def step_series(steps: Sequence[dict[str, Any]], start_wall: float) -> list[dict[str, float]]:
    """Per step, for the plot: seconds since ``start_wall``, execute and finish-to-finish ms, batch."""
    series: list[dict[str, float]] = []
    previous: dict[str, Any] | None = None
    for step in steps:
        consecutive = previous is not None and previous["actor"] == step["actor"] \
            and step["step_id"] == previous["step_id"] + 1
        interval_ms = (step["mono"] - previous["mono"]) * 1e3 if consecutive and previous else step["execute_ms"]
        series.append({"t": step["wall"] - start_wall, "execute_ms": step["execute_ms"], "interval_ms": interval_ms,
                       "num_seqs": step["num_seqs"], "num_tokens": step["num_tokens"]})
        previous = step
    return series


def request_latencies(
    records: Iterable[dict[str, Any]], request_ids: set[str]
) -> tuple[LatencyStats, LatencyStats, int]:
    """TTFT (ARRIVED -> FIRST_TOKEN, wall clocks: two actors) and ITL (consecutive TOKENS of a
    request, one actor's mono clock) of ``request_ids``; and how many of them had an ARRIVED."""
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    last_token: dict[str, tuple[str, float, float]] = {}
    gaps: list[float] = []
    for record in records:
        kind = record.get("type")
        if kind == "ARRIVED" and record["request_id"] in request_ids:
            arrived.setdefault(record["request_id"], record["wall"])
        elif kind == "FIRST_TOKEN" and record["request_id"] in request_ids:
            first_token.setdefault(record["request_id"], record["wall"])
        elif kind == "TOKENS":
            actor, mono, wall = record["actor"], record["mono"], record["wall"]
            for request_id in record["request_ids"]:
                if request_id not in request_ids:
                    continue
                last = last_token.get(request_id)
                if last is not None:
                    gaps.append(max(0.0, mono - last[1] if last[0] == actor else wall - last[2]))
                last_token[request_id] = (actor, mono, wall)
    ttfts = [max(0.0, first_token[rid] - arrived[rid]) for rid in request_ids if rid in arrived and rid in first_token]
    return LatencyStats.of(ttfts), LatencyStats.of(gaps), len(arrived)


def percentiles_dict(value: Any) -> dict[str, Any]:
    return msgspec.to_builtins(value) if isinstance(value, msgspec.Struct) else dict(value)
