"""Where a served token's way to the client is spent, from this engine's own histograms on
``/metrics``: ``vllm_actors:output_transit_seconds`` (the worker's result to the server) and
``vllm_actors:stream_wait_seconds`` (waiting in the server until its response took it), read before
and after a load; the difference is that load's. A server without them (vLLM) gives nothing.

Quantiles come from the bucket counts, so they are upper bounds: "p99 <= 20 ms" means at least
99% of the samples were at most 20 ms.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any

FAMILIES = {"transit": "vllm_actors:output_transit_seconds", "stream_wait": "vllm_actors:stream_wait_seconds"}
Histograms = dict[str, dict[str, Any]]  # short name -> {"buckets": {le: cumulative count}, "count", "sum"}


def scrape(url: str, timeout: float = 5.0) -> Histograms | None:
    """The two histograms, summed over their label sets (replicas); None when unreadable."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:  # noqa: S310 - a local URL
            text = response.read().decode()
    except (OSError, urllib.error.URLError):
        return None
    found: Histograms = {}
    names = {name: short for short, name in FAMILIES.items()}
    for family in text_string_to_metric_families(text):
        short = names.get(family.name)
        if short is None:
            continue
        entry = found.setdefault(short, {"buckets": {}, "count": 0.0, "sum": 0.0})
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                entry["buckets"][bound] = entry["buckets"].get(bound, 0.0) + sample.value
            elif sample.name.endswith("_count"):
                entry["count"] += sample.value
            elif sample.name.endswith("_sum"):
                entry["sum"] += sample.value
    return found or None


def difference(before: Histograms | None, after: Histograms | None) -> dict[str, dict[str, float]]:
    """Per histogram, the load's samples: count, mean, and p50 / p90 / p99 upper bounds (seconds)."""
    if not after:
        return {}
    report: dict[str, dict[str, float]] = {}
    for short, entry in after.items():
        old = (before or {}).get(short, {"buckets": {}, "count": 0.0, "sum": 0.0})
        count = entry["count"] - old["count"]
        if count <= 0:
            continue
        buckets = sorted((bound, value - old["buckets"].get(bound, 0.0)) for bound, value in entry["buckets"].items())
        row = {"count": count, "mean": (entry["sum"] - old["sum"]) / count}
        for name, share in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99)):
            row[name] = next((bound for bound, cumulative in buckets if cumulative >= share * count), float("inf"))
        report[short] = row
    return report


def describe(delays: dict[str, dict[str, float]]) -> str:
    """One line: mean and p99 bound of each, in ms."""
    parts = [f"{short} mean {row['mean'] * 1e3:.2f} ms, p99 <= {row['p99'] * 1e3:g} ms"
             for short, row in delays.items()]
    return "; ".join(parts)
