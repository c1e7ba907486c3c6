"""``bench serve --long-prompt-tokens N``: one long request injected into a Poisson stream of short
ones. Each rate is run twice on the same short requests: the stream alone (load kind ``rate``),
then with the long request sent ``--long-at`` seconds in (kind ``rate+long``). Reported for the
second run (``summary["long"]``): the long request's TTFT, end-to-end time and decode ms/token, and
the short requests' TTFT p99 (those sent while the long prompt was prefilling), inter-token p99
(gaps that ended in that window) and output tok/s (their tokens that arrived in it, beside the
tokens asked for by the short requests sent in it), against the same window of the run without it
(``baseline``) and against the second half of the time before the long request was sent in the
same run (``before``: what ``--long-only`` still has, the set warmed up by then). ``kept``: the
window's short output tok/s over the baseline's (the ``before`` window's without a baseline).

A short request's token times are rebuilt from the client's record: its send time plus its TTFT,
then each inter-token gap in turn."""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from typing import Any

from vllm_actors.bench.serve_client import TOKEN_ID_RANGE, RequestResult, ServeRequest, spread, tpot

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
    """The short requests' TTFT (those sent in [begin, end)), inter-token gaps ending in it, and
    output tok/s: the tokens that arrived in it (a chunk counting the request's tokens per chunk),
    beside ``offered_tok_s``, the tokens asked for by the requests sent in it, per second."""
    ttft = [r.ttft for r in results if r.ok and begin <= r.start < end]
    gaps = []
    tokens = 0.0
    for result in results:
        if not result.ok:
            continue
        times = token_times(result)
        gaps += [gap for gap, at in zip(result.itl, times[1:], strict=True) if begin <= at < end]
        per_chunk = result.output_tokens / max(1, len(times))
        tokens += per_chunk * sum(1 for at in times if begin <= at < end)
    seconds = max(end - begin, 1e-9)
    offered = sum(r.max_tokens for r in results if begin <= r.start < end)
    return {"ttft": spread(ttft), "itl": spread(gaps), "seconds": end - begin, "output_tok_s": tokens / seconds,
            "offered_tok_s": offered / seconds}


def long_summary(results: list[RequestResult], baseline: list[RequestResult] | None, start: float,
                 baseline_start: float) -> dict[str, Any]:
    """The long request (the last result) and the short ones around its prefill, with the same
    window (from each load's start) of the run without it."""
    long, short = results[-1], results[:-1]
    begin, end = long.start, long.start + (long.ttft if long.ok else long.e2e)
    decode = tpot(long.ttft, long.e2e, long.output_tokens) if long.ok else None
    summary: dict[str, Any] = {
        "prompt_tokens": long.prompt_len, "ok": long.ok, "error": long.error, "ttft_s": long.ttft,
        "e2e_s": long.e2e, "output_tokens": long.output_tokens,
        "decode_ms_per_token": decode * 1e3 if decode is not None else None,
        "window_s": [begin - start, end - start],
        "during": window_figures(short, begin, end),
        "before": window_figures(short, start + (begin - start) / 2, begin),
    }
    if baseline is not None:
        summary["baseline"] = window_figures(baseline, begin - start + baseline_start, end - start + baseline_start)
    reference = summary.get("baseline", summary["before"])
    summary["kept"] = (summary["during"]["output_tok_s"] / reference["output_tok_s"]
                       if long.ok and reference["output_tok_s"] > 0 else None)
    summary["kept_against"] = "baseline" if "baseline" in summary else "before"
    return summary


def describe(name: str, summary: dict[str, Any]) -> str:
    """One line: the long request and the short requests' p99s in its prefill, with and without it."""
    long = summary["long"]
    during = long["during"]
    decode = long.get("decode_ms_per_token")
    outcome = (f"its TTFT {long['ttft_s']:.1f} s" + (f", decode {decode:.1f} ms/token" if decode is not None else "")
               if long.get("ok", True) else f"FAILED after {long['e2e_s']:.1f} s: {long.get('error', '')[:300]}")
    line = (f"{name} {summary['value']:g}/s + {long['prompt_tokens']:,}-token request: {outcome}; "
            f"short requests in its prefill: TTFT p99 {during['ttft']['p99'] * 1e3:.1f} ms "
            f"({during['ttft']['count']}), ITL p99 {during['itl']['p99'] * 1e3:.1f} ms ({during['itl']['count']} gaps)")
    if "output_tok_s" in during:  # (reports of older runs have no throughput)
        line += f", {during['output_tok_s']:,.0f} out tok/s (asked {during['offered_tok_s']:,.0f})"
    for key, label in (("baseline", "without it"), ("before", "before it")):
        if key not in long:
            continue
        base = long[key]
        line += (f"; {label}: TTFT p99 {base['ttft']['p99'] * 1e3:.1f} ms, "
                 f"ITL p99 {base['itl']['p99'] * 1e3:.1f} ms")
        if "output_tok_s" in base:
            line += f", {base['output_tok_s']:,.0f} out tok/s (asked {base['offered_tok_s']:,.0f})"
    if long.get("kept") is not None:
        line += f"; short tok/s kept: {long['kept']:.0%} of {long['kept_against']}"
    return line
