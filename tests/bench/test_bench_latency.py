"""``vllm-actors bench latency`` on a tiny checkpoint on CPU: the shape of what it reports, not its speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_actors.bench.latency import PERCENTILES, LatencyResult, dummy_prompts, format_result
from vllm_actors.cli import build_parser


def test_result_figures_are_the_mean_and_the_interpolated_percentiles() -> None:
    result = LatencyResult([4.0, 1.0, 3.0, 2.0])
    assert result.avg_latency == 2.5
    figures = result.percentiles()
    assert list(figures) == list(PERCENTILES) and figures[50] == 2.5 and figures[10] == pytest.approx(1.3)
    data = result.to_dict()
    assert data["latencies"] == [4.0, 1.0, 3.0, 2.0] and data["percentiles"]["99"] == pytest.approx(3.97)
    assert format_result(result).splitlines()[0] == "Avg latency: 2.5 seconds"


def test_dummy_prompts_fit_the_vocabulary() -> None:
    prompts = dummy_prompts(3, 5, vocab_size=7, seed=0)
    assert [len(prompt) for prompt in prompts] == [5] * 3 and all(0 <= t < 7 for p in prompts for t in p)
    assert prompts == dummy_prompts(3, 5, vocab_size=7, seed=0)


def test_every_runner_is_a_bench_subcommand() -> None:
    parser = build_parser()
    for which in ("throughput", "latency", "serve", "prefix", "chaos", "soak", "simulate"):
        assert parser.parse_args(["bench", which, "--x"]).rest == ["--x"]


def test_latency_on_a_tiny_checkpoint(tiny_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_actors.cli import main

    out = tmp_path / "latency.json"
    status = main(["bench", "latency", "--model", str(tiny_qwen3), "--device", "cpu", "--max-model-len", "128",
                   "--input-len", "8", "--output-len", "4", "--batch-size", "2", "--num-iters-warmup", "1",
                   "--num-iters", "3", "--output-json", str(out)])
    assert status == 0
    data = json.loads(out.read_text())
    assert set(data) == {"avg_latency", "latencies", "percentiles"}
    assert len(data["latencies"]) == 3 and all(seconds > 0 for seconds in data["latencies"])
    assert data["avg_latency"] == pytest.approx(sum(data["latencies"]) / 3)
    assert list(data["percentiles"]) == [str(share) for share in PERCENTILES]
    values = list(data["percentiles"].values())
    assert values == sorted(values) and min(data["latencies"]) <= values[0] <= values[-1] <= max(data["latencies"])
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("Avg latency: ") and printed[-1].startswith("99% percentile latency: ")
