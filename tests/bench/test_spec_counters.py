"""The speculation counters of the spec benchmark (``benchmarks/lib/spec_counters.py``) over fake metrics
shaped like vLLM's ``vllm.v1.metrics.reader`` ones: totals summed over label sets, each phase's
difference, the per-step figures both engines get, and vLLM's side (``peer_spec.py``) on a fake
``vllm`` module, with and without ``get_metrics``. No vLLM needed."""

from __future__ import annotations

import importlib
import json
import sys
import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from benchmarks.lib import spec_counters, spec_measure


@dataclass
class Counter:  # vllm.v1.metrics.reader.Counter's fields
    name: str
    labels: dict[str, str]
    value: int


@dataclass
class Vector:  # vllm.v1.metrics.reader.Vector's fields
    name: str
    labels: dict[str, str]
    values: list[int]


@dataclass
class Gauge:
    name: str
    labels: dict[str, str]
    value: float


def metrics(drafts: int, drafted: int, accepted: int, per_pos: list[int], engines: int = 1) -> list[Any]:
    """vLLM's snapshot: each counter once per engine (label ``engine``), beside unrelated metrics."""
    found: list[Any] = [Gauge("vllm:num_requests_running", {}, 3.0), Counter("vllm:prompt_tokens", {}, 999)]
    for engine in range(engines):
        labels = {"model_name": "m", "engine": str(engine)}
        found += [Counter("vllm:spec_decode_num_drafts", labels, drafts),
                  Counter("vllm:spec_decode_num_draft_tokens", labels, drafted),
                  Counter("vllm:spec_decode_num_accepted_tokens", labels, accepted),
                  Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, list(per_pos))]
    return found


def test_vllm_totals_sum_every_label_set_and_read_absent_counters_as_zero() -> None:
    assert spec_counters.vllm_totals(metrics(5, 20, 9, [4, 3, 2, 0], engines=2)) == {
        "num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 18, "accepted_per_pos": [8, 6, 4, 0]}
    no_speculation = [Gauge("vllm:num_requests_running", {}, 0.0)]  # vLLM without a speculative config
    assert spec_counters.vllm_totals(no_speculation) == {"num_drafts": 0, "num_draft_tokens": 0,
                                                         "num_accepted_tokens": 0, "accepted_per_pos": []}


class FakeVllm:
    """vLLM's ``LLM`` as the peer uses it: batch-1 calls draft 4 a step with 2 accepted; ``get_metrics``
    reads the totals (vLLM's metrics are cumulative)."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.drafts = self.drafted = self.accepted = 0
        self.per_pos = [0, 0, 0, 0]

    def step(self, tokens: int) -> None:  # each drafting step gives 3 tokens
        steps = tokens // 3
        self.drafts += steps
        self.drafted += 4 * steps
        self.accepted += 2 * steps
        self.per_pos = [self.per_pos[0] + steps, self.per_pos[1] + steps, *self.per_pos[2:]]

    def generate_tokens(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[int, float]:
        if len(prompts) == 1 and max_tokens == 12:
            self.step(max_tokens)
        return len(prompts) * max_tokens, 0.01

    def get_metrics(self) -> list[Any]:
        return metrics(self.drafts, self.drafted, self.accepted, self.per_pos)


def test_each_phase_gets_the_difference_of_vllms_counters() -> None:
    llm = FakeVllm()
    llm.step(300)  # before the run: the warm-up's and earlier calls' drafts are not a phase's
    counters = spec_counters.VllmCounters(llm)
    result = spec_measure.measure(llm.generate_tokens, [[1, 2]] * 8, 12, 2, [8], counters=counters)
    assert counters.note is None
    assert result["phase_drafting"]["batch1"] == {
        "num_drafts": 8, "num_draft_tokens": 32, "num_accepted_tokens": 16, "mean_k": 4.0,
        "drafting_share": 8 / (24 - 16), "tokens": 24, "accepted_per_pos": [8, 8, 0, 0]}
    assert result["phase_drafting"]["concurrency_8"]["num_drafts"] == 0
    assert result["phase_drafting"]["concurrency_8"]["accepted_per_pos"] == [0, 0, 0, 0]


def test_a_vllm_without_get_metrics_leaves_a_note_and_the_last_totals() -> None:
    class Failing:
        calls = 0

        def get_metrics(self) -> list[Any]:
            self.calls += 1
            if self.calls > 1:
                raise AssertionError("Stat logging disabled")
            return metrics(1, 4, 2, [1, 1, 0, 0])

    llm = Failing()
    counters = spec_counters.VllmCounters(llm)
    first = counters()
    assert counters() == first and counters() == first and llm.calls == 2  # no call after the failure
    assert counters.note == "unavailable: AssertionError: Stat logging disabled"


def test_step_figures_per_request_step_and_the_batch1_step_cost() -> None:
    drafting = spec_measure.drafting({}, {"num_drafts": 6, "num_draft_tokens": 24, "num_accepted_tokens": 12}, 20)
    off = spec_measure.drafting({}, {}, 20)
    result = {"batch1_ms_per_token": 2.0, "phase_drafting": {"batch1": drafting, "concurrency_8": off}}
    cost = spec_counters.step_cost(result)
    assert cost == {
        # 20 tokens in 8 request-steps (6 drafted, 2 did not: prefill or no n-gram match)
        "batch1": {"tokens_per_step": 2.5, "mean_acceptance_length": 3.0, "acceptance_rate": 0.5, "ms_per_step": 5.0},
        "concurrency_8": {"tokens_per_step": 1.0, "mean_acceptance_length": 1.0, "acceptance_rate": None}}
    assert spec_counters.step_cost({"error": "vLLM failed"}) is None
    assert spec_counters.step_cost({"batch1_ms_per_token": 2.0, "phase_drafting": {"batch1": {}}}) is None
    line = spec_counters.step_line("ngram", {"ours": cost, "vllm": None})
    assert line == "step cost ngram, batch 1: ours 5.000 ms/step (2.50 tokens/step, acceptance 0.50), vllm n/a"


@pytest.fixture
def peer_spec(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """``peer_spec`` imported with its folder on ``sys.path`` only for this test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "benchmarks.lib.peer_spec", raising=False)
    return importlib.import_module("benchmarks.lib.peer_spec")


def fake_vllm(llm_class: type) -> types.ModuleType:
    module = types.ModuleType("vllm")
    module.__dict__.update(__version__="0.0-fake", LLM=llm_class, SamplingParams=lambda **kwargs: kwargs)
    return module


class Output:
    def __init__(self, tokens: int) -> None:
        self.outputs = [types.SimpleNamespace(token_ids=list(range(tokens)))]


class PeerLLM(FakeVllm):
    made: list[PeerLLM] = []

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        PeerLLM.made.append(self)

    def generate(self, inputs: list[Any], params: dict[str, Any], use_tqdm: bool = False) -> list[Output]:
        self.generate_tokens(inputs, params["max_tokens"])
        return [Output(params["max_tokens"]) for _ in inputs]


class PeerLLMWithoutMetrics(PeerLLM):
    def get_metrics(self) -> list[Any]:
        raise AttributeError("'LLM' object has no attribute 'get_metrics'")


@pytest.mark.parametrize("with_metrics", [True, False])
def test_the_vllm_peer_records_its_counters_per_phase_or_a_note(
        peer_spec: types.ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, with_metrics: bool) -> None:
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm(PeerLLM if with_metrics else PeerLLMWithoutMetrics))
    ngram = {"method": "ngram", "num_speculative_tokens": 4}
    workload = {"prompts": [[1, 2, 3]] * 4, "output_len": 12, "repeats": 2, "concurrency": [4], "max_model_len": 64,
                "speculative_config": ngram, "speculative_configs": {"ngram": ngram}}
    (tmp_path / "w.json").write_text(json.dumps(workload))
    out = tmp_path / "r.json"
    assert peer_spec.main(["--model", "m", "--prompts", str(tmp_path / "w.json"), "--mode", "ngram",
                           "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert PeerLLM.made[-1].kwargs["disable_log_stats"] is False  # get_metrics needs vLLM's stats
    if with_metrics:
        assert result["phase_drafting"]["batch1"]["num_accepted_tokens"] == 16
        assert result["spec_decode"]["num_drafts"] == 8  # the warm-up drafted nothing: not 12 tokens a request
        cost = spec_counters.step_cost(result)
        assert cost is not None and cost["batch1"]["tokens_per_step"] == 3.0  # timed by the clock: any ms/token
        assert cost["batch1"]["ms_per_step"] == pytest.approx(3 * result["batch1_ms_per_token"])
    else:
        assert "phase_drafting" not in result
        assert result["spec_decode"].startswith("unavailable: AttributeError")


def test_the_benchmark_writes_and_prints_both_engines_step_cost(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script sets sys.path[0] to the repository
    monkeypatch.setenv("VLLM_ACTORS_DUMMY_WEIGHTS", "random")  # main sets it for our engines: undone after
    spec_decode = importlib.import_module("benchmarks.spec_decode")

    def phase(drafts: int, accepted: int, tokens: int) -> dict[str, Any]:
        return spec_measure.drafting({}, {"num_drafts": drafts, "num_draft_tokens": 4 * drafts,
                                          "num_accepted_tokens": accepted}, tokens)

    def run_ours(model: str, spec: dict[str, Any], modes: list[str], *args: Any,
                 **kwargs: Any) -> tuple[dict[str, Any], list[Any]]:
        assert modes == ["off", "draft"]
        return {"off": {"batch1_ms_per_token": 5.0, "phase_drafting": {"batch1": phase(0, 0, 100)}},
                "draft": {"batch1_ms_per_token": 8.0, "phase_drafting": {"batch1": phase(99, 0, 100)}}}, []

    peer = {"off": {"batch1_ms_per_token": 5.0, "phase_drafting": {"batch1": phase(0, 0, 100)}},
            "draft": {"batch1_ms_per_token": 2.0, "phase_drafting": {"batch1": phase(20, 80, 100)}}}
    monkeypatch.setattr(spec_decode.spec_ours, "run_ours", run_ours)
    monkeypatch.setattr(spec_decode, "run_peer", lambda args, path, mode: dict(peer[mode]))
    assert spec_decode.main(["--model-shape", "qwen3-0.6b", "--draft-layers", "2", "--modes", "off", "draft",
                             "--always-draft", "--concurrency", "--peer", "vllm", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["settings"]["vllm_stats"] is True
    assert results["ours_draft"]["step_cost"]["batch1"]["ms_per_step"] == 8.0  # every draft rejected
    assert results["vllm_draft"]["step_cost"]["batch1"]["ms_per_step"] == 10.0  # 5 tokens a step
    assert ("step cost draft, batch 1: ours 8.000 ms/step (1.00 tokens/step, acceptance 0.00), "
            "vllm 10.000 ms/step (5.00 tokens/step, acceptance 1.00)") in capsys.readouterr().out
