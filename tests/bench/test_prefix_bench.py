"""The prefix-caching benchmark: its workloads, its report, and one end-to-end run of ``main`` on a
tiny random Qwen3 on CPU (both workloads, caching on then off, four process groups)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_actors.bench.prefix import (
    PrefixReport,
    RunResult,
    StoreCounters,
    format_report,
    parse_workloads,
)
from vllm_actors.bench.prefix_workloads import (
    SUFFIX_LEN_RANGE,
    USER_LEN_RANGE,
    RequestTiming,
    make_chat_workload,
    make_shared_workload,
)


# --------------------------------------------------------------------------- the workloads
def test_shared_workload_shape_and_determinism() -> None:
    workload = make_shared_workload(num_requests=256, system_tokens=2000, max_tokens=128, vocab_size=151936)
    prompts = workload.prompts
    assert len(prompts) == workload.num_requests == 256
    assert all(prompt[:2000] == workload.system_prompt for prompt in prompts)
    assert all(SUFFIX_LEN_RANGE[0] <= len(prompt) - 2000 <= SUFFIX_LEN_RANGE[1] for prompt in prompts)
    assert all(0 <= token < 10_000 for prompt in prompts for token in prompt)
    assert workload.longest_sequence == max(len(prompt) for prompt in prompts) + 128
    assert make_shared_workload(256, 2000, 128, 151936) == workload  # seeded
    assert make_shared_workload(256, 2000, 128, 151936, seed=1) != workload
    tiny = make_shared_workload(4, 64, 4, vocab_size=512)
    assert all(0 <= token < 512 for prompt in tiny.prompts for token in prompt)
    with pytest.raises(ValueError, match="num_requests"):
        make_shared_workload(num_requests=0)


def test_chat_workload_shape() -> None:
    workload = make_chat_workload(conversations=64, turns=4, concurrency=16, max_tokens=128)
    assert len(workload.user_turns) == 64 and all(len(turns) == 4 for turns in workload.user_turns)
    assert workload.num_requests == 256
    lengths = [len(user) for turns in workload.user_turns for user in turns]
    assert min(lengths) >= USER_LEN_RANGE[0] and max(lengths) <= USER_LEN_RANGE[1]
    assert workload.longest_sequence == max(sum(len(user) + 128 for user in turns) for turns in workload.user_turns)
    assert workload.longest_sequence <= 4096  # fits the default --max-model-len
    with pytest.raises(ValueError, match="concurrency"):
        make_chat_workload(concurrency=0)


def test_parse_workloads() -> None:
    assert parse_workloads("shared,chat") == ("shared", "chat")
    assert parse_workloads(" chat , chat ") == ("chat",)
    for bad in ("", "shared,nope"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_workloads(bad)


# --------------------------------------------------------------------------- the report
def _summary(queries: int | None, hits: int | None, finished: int = 0) -> SimpleNamespace:
    reply = SimpleNamespace(requests_finished=finished, requests_aborted=0, prefill_tokens=100, preemptions=0, steps=7)
    if queries is not None:
        reply.prefix_cache_queries, reply.prefix_cache_hits = queries, hits
    return reply


def _run(prefix_caching: bool, ttfts: list[float], seconds: float, store: StoreCounters) -> RunResult:
    timings = [RequestTiming(prompt_tokens=100, output_tokens=10, ttft_s=ttft, e2e_s=ttft + 1.0,
                             finish_reason="length") for ttft in ttfts]
    return RunResult.of("shared", prefix_caching, timings, seconds, store)


def test_store_counters_and_hit_rate() -> None:
    before = StoreCounters.of(_summary(1000, 100, finished=2))
    after = StoreCounters.of(_summary(3000, 1600, finished=6))
    delta = after.since(before)
    assert (delta.ended, delta.prefix_cache_queries, delta.prefix_cache_hits) == (4, 2000, 1500)
    assert _run(True, [0.1], 1.0, delta).hit_rate == pytest.approx(0.75)
    missing = StoreCounters.of(_summary(None, None, finished=6)).since(StoreCounters.of(_summary(None, None)))
    assert missing.prefix_cache_queries is None and _run(True, [0.1], 1.0, missing).hit_rate is None


def test_report_ratios_table_and_json(tmp_path: Path) -> None:
    from vllm_actors.bench.report import write_json

    store = StoreCounters(ended=4, prefix_cache_queries=400, prefix_cache_hits=300, prefill_tokens=100,
                          preemptions=0)
    report = PrefixReport(config={"model_description": "tiny"})
    report.add(_run(True, [0.1, 0.1, 0.2, 0.2], 2.0, store))
    report.add(_run(False, [0.3, 0.3, 0.6, 0.6], 4.0, StoreCounters(4, None, None, 400, 0)))
    report.errors["chat/on"] = "RuntimeError: boom"
    ratios = report.ratios("shared")
    assert ratios is not None
    assert ratios["ttft_p50_off_over_on"] == pytest.approx(3.0)
    assert ratios["output_tokens_per_s_on_over_off"] == pytest.approx(2.0)
    table = format_report(report)
    assert "TTFT p50 off/on" in table and "3.00x" in table and "75.0%" in table and "error: chat/on" in table
    write_json(report, tmp_path / "results.json")
    data = json.loads((tmp_path / "results.json").read_text())
    shared = data["workloads"]["shared"]
    assert shared["on"]["hit_rate"] == 0.75 and shared["off"]["hit_rate"] is None
    assert shared["on"]["output_tokens_per_s"] == pytest.approx(20.0)
    assert shared["on"]["total_tokens_per_s"] == pytest.approx(220.0)
    assert shared["ratios"]["total_tokens_per_s_on_over_off"] == pytest.approx(2.0)


# --------------------------------------------------------------------------- end to end
def test_main_end_to_end_on_cpu(tiny_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_actors.bench.prefix import main

    out = tmp_path / "out"
    status = main([
        "--model", str(tiny_qwen3), "--dtype", "float32", "--device", "cpu",
        "--num-requests", "4", "--system-tokens", "64",
        "--conversations", "2", "--turns", "2", "--concurrency", "2",
        "--max-tokens", "4", "--warmup-requests", "1", "--workloads", "chat",  # shared: the unit tests above
        "--out", str(out), "--log-level", "WARNING",
    ])
    results = json.loads((out / "results.json").read_text())
    assert status == 0, results["errors"]
    assert results["errors"] == {}
    assert set(results["workloads"]) == {"chat"}
    sent = {"chat": 2 * 2}
    for name, workload in results["workloads"].items():
        for key in ("on", "off"):
            run = workload[key]
            assert run["prefix_caching"] is (key == "on")
            assert run["num_requests"] == run["completed"] == sent[name]
            assert run["output_tokens"] == 4 * sent[name]
            assert run["seconds"] > 0 and run["output_tokens_per_s"] > 0
            assert run["total_tokens_per_s"] > run["output_tokens_per_s"]
            assert run["ttft"]["count"] == sent[name] and len(run["ttft_samples"]) == sent[name]
            assert 0 < run["ttft"]["p50"] <= run["ttft"]["p99"] <= run["e2e"]["max"]
            assert run["hit_rate"] is None or 0.0 <= run["hit_rate"] <= 1.0
        if workload["on"]["prefix_cache_queries"] is not None:  # the store reports prefix caching
            assert workload["on"]["prefix_cache_hits"] > 0  # the shared prompt, the previous turn
            assert not workload["off"]["prefix_cache_hits"]
        assert all(value is None or value > 0 for value in workload["ratios"].values())
    vocab_size = json.loads((tiny_qwen3 / "config.json").read_text())["vocab_size"]
    chat = make_chat_workload(2, 2, 2, 4, vocab_size)
    # turn 2 resends turn 1's prompt and its 4 generated tokens
    chat_prompt_tokens = sum(2 * len(first) + 4 + len(second) for first, second in chat.user_turns)
    for key in ("on", "off"):
        assert results["workloads"]["chat"][key]["prompt_tokens"] == chat_prompt_tokens
    table = capsys.readouterr().out
    assert "TTFT p50 off/on" in table and "chat" in table
