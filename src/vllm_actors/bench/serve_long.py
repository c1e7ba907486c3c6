"""``bench serve --long-prompt-tokens N``: one long request injected into a Poisson stream of short
ones. Each rate is run twice on the same short requests: the stream alone (load kind ``rate``),
then with the long request sent ``--long-at`` seconds in (kind ``rate+long``). Reported for the
second run (``summary["long"]``): the long request's TTFT and end-to-end time, and the short
requests' TTFT p99 (those sent while the long prompt was prefilling) and inter-token p99 (gaps
that ended in that window), against the same window of the run without it (``baseline``).

A short request's token times are rebuilt from the client's record: its send time plus its TTFT,
then each inter-token gap in turn."""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

from vllm_actors.bench.serve_client import TOKEN_ID_RANGE, RequestResult, ServeRequest, spread

LONG_KIND = "rate+long"


def add_long_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("a long request in the stream")
    group.add_argument("--long-prompt-tokens", type=int, default=0,
                       help="run each rate twice, the second time with one request of this many prompt tokens "
                            "injected (0: off)")
    group.add_argument("--long-at", type=float, default=10.0, help="seconds into the load the long request is sent")
    group.add_argument("--long-max-tokens", type=int, default=16, help="the long request's output tokens")
    group.add_argument("--long-only", action="store_true",
                       help="skip each rate's run alone (its baseline measured in an earlier call, same settings)")


def load_kinds(args: argparse.Namespace, kind: str, value: float) -> list[tuple[str, float]]:
    """A rate's runs: itself, then (with a long prompt asked for) itself with the long request."""
    if kind == "rate" and args.long_prompt_tokens > 0:
        return [(LONG_KIND, value)] if args.long_only else [(kind, value), (LONG_KIND, value)]
    return [(kind, value)]


def with_long(args: argparse.Namespace, requests: list[ServeRequest], seed: int) -> list[ServeRequest]:
    """The short requests and, last, the long one (its own random tokens: no prefix-cache hit)."""
    rng = random.Random(seed + 7)
    prompt = [rng.randint(*TOKEN_ID_RANGE) for _ in range(args.long_prompt_tokens)]
    return [*requests, ServeRequest(len(requests), prompt, args.long_max_tokens, offset=args.long_at)]


def token_times(result: RequestResult) -> list[float]:
    """When each streamed chunk of a request arrived (monotonic)."""
    times = [result.start + result.ttft]
    for gap in result.itl:
        times.append(times[-1] + gap)
    return times


def window_figures(results: Sequence[RequestResult], begin: float, end: float) -> dict[str, Any]:
    """The short requests' TTFT (those sent in [begin, end)) and inter-token gaps ending in it."""
    ttft = [r.ttft for r in results if r.ok and begin <= r.start < end]
    gaps = []
    for result in results:
        if not result.ok:
            continue
        times = token_times(result)
        gaps += [gap for gap, at in zip(result.itl, times[1:], strict=True) if begin <= at < end]
    return {"ttft": spread(ttft), "itl": spread(gaps)}


def long_summary(results: list[RequestResult], baseline: list[RequestResult] | None, start: float,
                 baseline_start: float) -> dict[str, Any]:
    """The long request (the last result) and the short ones around its prefill, with the same
    window (from each load's start) of the run without it."""
    long, short = results[-1], results[:-1]
    begin, end = long.start, long.start + (long.ttft if long.ok else long.e2e)
    summary: dict[str, Any] = {
        "prompt_tokens": long.prompt_len, "ok": long.ok, "error": long.error, "ttft_s": long.ttft,
        "e2e_s": long.e2e, "window_s": [begin - start, end - start],
        "during": window_figures(short, begin, end),
    }
    if baseline is not None:
        summary["baseline"] = window_figures(baseline, begin - start + baseline_start, end - start + baseline_start)
    return summary


def describe(name: str, summary: dict[str, Any]) -> str:
    """One line: the long request and the short requests' p99s in its prefill, with and without it."""
    long = summary["long"]
    during = long["during"]
    line = (f"{name} {summary['value']:g}/s + {long['prompt_tokens']:,}-token request: "
            f"its TTFT {long['ttft_s']:.1f} s; "
            f"short requests in its prefill: TTFT p99 {during['ttft']['p99'] * 1e3:.1f} ms "
            f"({during['ttft']['count']}), ITL p99 {during['itl']['p99'] * 1e3:.1f} ms ({during['itl']['count']} gaps)")
    if "baseline" in long:
        base = long["baseline"]
        line += (f"; without it: TTFT p99 {base['ttft']['p99'] * 1e3:.1f} ms, "
                 f"ITL p99 {base['itl']['p99'] * 1e3:.1f} ms")
    return line
