"""``bench serve --long-prompt-tokens``: each rate run alone and with one long request, the same
short requests both times, and the short requests' figures in the long prefill's window."""

from __future__ import annotations

import pytest

from vllm_actors.bench import serve_long
from vllm_actors.bench.serve import build_parser, format_row, load_requests, loads
from vllm_actors.bench.serve_client import RequestResult


def short(index: int, start: float, ttft: float, gaps: list[float]) -> RequestResult:
    return RequestResult(index, 2048, len(gaps) + 1, start=start, ok=True, ttft=ttft, e2e=ttft + sum(gaps),
                         itl=gaps, output_tokens=len(gaps) + 1, chunks=len(gaps) + 1)


def test_each_rate_runs_alone_then_with_the_long_request() -> None:
    args = build_parser().parse_args(["--rates", "2", "--duration", "5", "--input-len", "2048", "2048",
                                      "--output-len", "256", "256", "--long-prompt-tokens", "5000", "--long-at", "1.5"])
    assert loads(args) == [("rate", 2.0), (serve_long.LONG_KIND, 2.0)]
    alone = load_requests(args, "rate", 2.0, 1000)
    mixed = load_requests(args, serve_long.LONG_KIND, 2.0, 1000)
    assert mixed[:-1] == alone and all(len(r.prompt) == 2048 and r.max_tokens == 256 for r in alone)
    assert (len(mixed[-1].prompt), mixed[-1].offset, mixed[-1].index) == (5000, 1.5, len(alone))
    assert loads(build_parser().parse_args(["--rates", "2"])) == [("rate", 2.0)]  # off by default
    only = build_parser().parse_args(["--rates", "2", "--long-prompt-tokens", "5000", "--long-only"])
    assert loads(only) == [(serve_long.LONG_KIND, 2.0)]  # its baseline from an earlier call


def test_the_short_requests_are_measured_in_the_long_prefills_window() -> None:
    # Load start 100.0; the long request sent at 101 with its first token at 104: window [101, 104).
    base = [short(0, 100.5, 0.05, [0.01] * 5), short(1, 101.2, 0.05, [0.01] * 5)]
    during = [short(0, 100.5, 0.05, [0.01, 0.01, 0.5, 0.01, 0.01]),  # tokens at 100.55 .. 101.09
              short(1, 101.2, 0.9, [0.2, 0.2, 0.01, 0.01, 0.01]),
              short(2, 105.0, 0.05, [0.3])]  # after the window: not counted
    long = RequestResult(3, 5000, 16, start=101.0, ok=True, ttft=3.0, e2e=3.5, output_tokens=16, chunks=16,
                         itl=[0.03] * 15)
    summary = serve_long.long_summary([*during, long], [*base, short(2, 105.0, 0.05, [0.01])], 100.0, 100.0)
    assert summary["window_s"] == [1.0, 4.0] and summary["ttft_s"] == 3.0
    assert summary["during"]["ttft"]["count"] == 1 and summary["during"]["ttft"]["p99"] == pytest.approx(0.9)
    assert summary["during"]["itl"]["count"] == 3 + 5  # request 0: its gaps ending at 101.07, .08, .09
    assert summary["during"]["itl"]["max"] == pytest.approx(0.5)
    assert summary["baseline"]["ttft"]["p99"] == pytest.approx(0.05) and summary["baseline"]["itl"]["count"] == 5
    # short tokens in the window: request 0's last three, request 1's six, over 3 s; asked: request 1's 6
    assert summary["during"]["output_tok_s"] == pytest.approx(3.0)
    assert summary["during"]["offered_tok_s"] == pytest.approx(2.0)
    assert summary["baseline"]["output_tok_s"] == pytest.approx(2.0)  # request 1's six tokens
    assert (summary["kept"], summary["kept_against"]) == (pytest.approx(1.5), "baseline")
    # before it: the second half of the second before the long request, [100.5, 101): request 0's first three
    assert summary["before"]["output_tok_s"] == pytest.approx(6.0)
    assert summary["before"]["ttft"]["count"] == 1 and summary["before"]["offered_tok_s"] == pytest.approx(12.0)
    assert summary["decode_ms_per_token"] == pytest.approx(500 / 15)
    record = {"kind": serve_long.LONG_KIND, "value": 2.0, "long": summary}
    line = serve_long.describe("ours", record)
    assert "TTFT p99 900.0 ms" in line and "decode 33.3 ms/token" in line
    assert "without it: TTFT p99 50.0 ms" in line and "kept: 150% of baseline" in line
    alone = serve_long.long_summary([*during, long], None, 100.0, 0.0)  # --long-only: against the time before
    assert (alone["kept"], alone["kept_against"]) == (pytest.approx(0.5), "before") and "baseline" not in alone
    refused = RequestResult(3, 5000, 16, start=101.0, e2e=0.01, error="RuntimeError: more than the replicas hold")
    failed = serve_long.long_summary([*during, refused], None, 100.0, 0.0)
    assert failed["kept"] is None and failed["decode_ms_per_token"] is None
    line = serve_long.describe("ours", {"kind": serve_long.LONG_KIND, "value": 2.0, "long": failed})
    assert "request: FAILED after 0.0 s: RuntimeError: more than the replicas hold;" in line and "kept" not in line


def test_the_table_row_names_the_long_request() -> None:
    spread = {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    row = {"kind": serve_long.LONG_KIND, "value": 2.0, "sent": 3, "failed": 0, "output_tok_s": 1.0, "ttft": spread,
           "itl": spread, "e2e": spread, "tpot": spread, "tokens_per_chunk": 1.0,
           "goodput": {"share": 1.0, "rate": 1.0}, "long": {"prompt_tokens": 1_000_000}}
    assert format_row("ours", row).startswith("| ours | 2/s + 1,000,000-token request | 3 |")


def test_a_model_shape_reaches_the_long_requests_context() -> None:
    from vllm_actors.bench.serve import shape_config

    args = build_parser().parse_args(["--model-shape", "llama-3.2-1b", "--max-model-len", "1050000"])
    config = shape_config(args)
    assert config["max_position_embeddings"] == 1050000 and config["num_hidden_layers"] == 16
    assert config["rope_scaling"]["original_max_position_embeddings"] == 8192  # the rope's arithmetic unchanged
    assert shape_config(build_parser().parse_args([]))["max_position_embeddings"] == 40960  # Qwen3-0.6B's own
