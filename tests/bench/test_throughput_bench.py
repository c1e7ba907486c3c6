"""The throughput benchmark at tiny scale on CPU: its floor model, its workload, the idle-share
computation, the report, and one end-to-end run of ``benchmarks/throughput.py``'s ``main`` (the
package's runner plus the comparisons) on a tiny random Qwen3."""

from __future__ import annotations

import gzip
import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib.compare_report import ComparisonReport
from benchmarks.lib.floor import ModelShape, workload_floor

from tests.support.trace_check import check_covers
from vllm_actors.bench.report import LatencyStats, OursResult, format_table, percentile, write_json
from vllm_actors.bench.throughput import (
    EXPECTED_OUTPUT_TOKENS,
    QWEN3_0_6B_CONFIG,
    decode_idle_share,
    make_workload,
    request_latencies,
    step_series,
    worker_steps,
)
from vllm_actors.protocol.metrics import parse_event_json_line

TINY_QWEN3_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "torch_dtype": "bfloat16",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "eos_token_id": 0,
}


# --------------------------------------------------------------------------- the workload
def test_workload_is_nano_vllms() -> None:
    random.seed(0)  # the definition, literally
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]

    workload = make_workload()
    assert len(workload) == 256
    assert workload.prompts == prompts
    assert workload.max_tokens == max_tokens
    assert workload.output_tokens == EXPECTED_OUTPUT_TOKENS == 133_966
    assert workload.prompt_tokens == sum(len(p) for p in prompts)
    assert all(100 <= len(p) <= 1024 for p in workload.prompts)
    assert all(0 <= t <= 10000 for p in workload.prompts for t in p)


def test_workload_subsets_and_scaling() -> None:
    full = make_workload()
    head = make_workload(16)
    assert head.prompts == full.prompts[:16] and head.max_tokens == full.max_tokens[:16]
    small = make_workload(4, max_input_len=32, max_output_len=8)
    assert [len(p) for p in small.prompts] == [32] * 4
    assert small.prompts == [p[:32] for p in full.prompts[:4]]
    assert small.max_tokens == [8] * 4
    folded = small.fit_vocab(512)
    assert all(0 <= t < 512 for p in folded.prompts for t in p)
    assert full.fit_vocab(151936) is full
    with pytest.raises(ValueError):
        make_workload(0)


# --------------------------------------------------------------------------- the floor
def test_qwen3_shape() -> None:
    shape = ModelShape.from_hf_config(QWEN3_0_6B_CONFIG)
    assert shape.kv_bytes_per_token == 28 * 2 * 8 * 128 * 2 == 114_688
    assert 590e6 < shape.num_parameters < 600e6  # Qwen3-0.6B: 596M with the tied embedding once
    assert shape.weight_bytes_per_step == 2 * shape.num_parameters


def test_floor_of_the_default_workload() -> None:
    """≈5.2 s ≈ 25,500 output tok/s at 3.0 TB/s and 790 TFLOP/s."""
    workload = make_workload()
    floor = workload_floor(
        [len(p) for p in workload.prompts], workload.max_tokens, ModelShape.from_hf_config(QWEN3_0_6B_CONFIG),
        bandwidth=3.0e12, matmul_rate=790e12, max_num_seqs=256,
    )
    assert floor.output_tokens == 133_966
    assert floor.tokens_per_s == pytest.approx(25_500, rel=0.03)
    assert floor.seconds == pytest.approx(5.2, rel=0.03)
    assert floor.decode_steps == max(workload.max_tokens) - 1  # the prefill gives the first token
    assert floor.memory_bound_steps == floor.decode_steps  # decode is bandwidth-bound throughout
    assert floor.prefill_seconds == pytest.approx(2 * 596_049_920 * workload.prompt_tokens / 790e12, rel=1e-3)


def test_floor_step_model_by_hand() -> None:
    shape = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=4, tie_word_embeddings=True)
    # two requests: prompts 3 and 5, outputs 3 and 2 -> decode steps: {ctx 4, ctx 6}, then {ctx 5}
    floor = workload_floor([3, 5], [3, 2], shape, bandwidth=1.0, matmul_rate=1e30)
    weights, kv = shape.weight_bytes_per_step, shape.kv_bytes_per_token
    assert floor.decode_steps == 2
    assert floor.decode_seconds == pytest.approx((weights + 10 * kv) + (weights + 5 * kv))
    # one slot: the second request waits for the first
    queued = workload_floor([3, 5], [3, 2], shape, bandwidth=1.0, matmul_rate=1e30, max_num_seqs=1)
    assert queued.decode_steps == 3
    assert queued.decode_seconds == pytest.approx((weights + 4 * kv) + (weights + 5 * kv) + (weights + 6 * kv))


# --------------------------------------------------------------------------- the event log
def _step(step_id: int, mono: float, execute_ms: float, num_seqs: int = 8, num_tokens: int | None = None,
          actor: str = "worker-0") -> dict[str, Any]:
    return {"actor": actor, "seq": step_id, "mono": mono, "wall": 1000.0 + mono, "type": "STEP_FINISHED",
            "step_id": step_id, "num_seqs": num_seqs, "num_tokens": num_seqs if num_tokens is None else num_tokens,
            "num_sampled": num_seqs, "execute_ms": execute_ms}


def test_gpu_busy_shares_come_from_the_device_clock_of_stages_timed_throughout() -> None:
    from vllm_actors.bench.event_log import gpu_busy_shares

    def timed(step_id: int, start: float, end: float, actor: str) -> dict[str, Any]:
        return {"actor": actor, "seq": step_id, "mono": end, "wall": 1000.0 + end, "type": "STEP_TIMED",
                "step_id": step_id, "stage": 0, "gpu_ms": (end - start) * 1e3, "gpu_start": start, "gpu_end": end}

    records = [
        *(_step(step_id, 1.0 + step_id, 1.0, actor="worker-0") for step_id in range(3)),
        timed(0, 10.0, 10.3, "worker-0"), timed(1, 10.3, 10.6, "worker-0"),
        timed(2, 10.8, 11.0, "worker-0"),  # 0.2 s idle before it: busy 0.8 of 1.0 s
        *(_step(step_id, 1.0 + step_id, 1.0, actor="worker-1") for step_id in range(2)),
        timed(0, 5.0, 5.5, "worker-1"),  # one of two steps timed on the GPU: no device-clock share
    ]
    assert gpu_busy_shares(records) == {"worker-0": pytest.approx(0.8)}


def test_decode_idle_share_on_a_synthetic_log() -> None:
    records = [
        _step(0, 0.5, 10.0),  # warm-up, before the run: left out by since_wall
        {"actor": "scheduler", "seq": 1, "mono": 0.9, "wall": 1000.9, "type": "TOKENS", "step_id": 0,
         "request_ids": ["a"], "num_output_tokens": [1]},
        _step(10, 1.000, 50.0, num_seqs=4, num_tokens=400),  # prefill
        _step(11, 1.100, 80.0),  # after a prefill step: not a decode pair
        _step(12, 1.200, 90.0),  # 100 ms apart, 90 executing: 10 ms idle
        _step(13, 1.300, 100.0),  # 0 idle
        _step(14, 1.450, 100.0),  # 50 ms idle
        _step(16, 1.600, 10.0),  # step 15 missing: not consecutive
        _step(17, 1.620, 30.0),  # execute longer than the interval: 0 idle
        _step(5, 1.300, 1.0, actor="worker-1"),  # another worker, alone
    ]
    steps = worker_steps(records, since_wall=1000.9)
    assert [step["step_id"] for step in steps] == [10, 11, 12, 13, 14, 16, 17, 5]
    idle = decode_idle_share(steps)
    assert idle is not None
    assert idle.pairs == 4
    assert idle.idle_s == pytest.approx(0.010 + 0.0 + 0.050 + 0.0)
    assert idle.interval_s == pytest.approx(0.100 + 0.100 + 0.150 + 0.020)
    assert idle.share == pytest.approx(0.060 / 0.370)
    assert decode_idle_share([_step(1, 1.0, 5.0, num_tokens=9)]) is None

    series = step_series(steps, start_wall=1001.0)
    assert series[0]["t"] == pytest.approx(0.0)
    assert series[2]["interval_ms"] == pytest.approx(100.0)
    assert series[5]["interval_ms"] == pytest.approx(10.0)  # no predecessor: its execute time


def test_request_latencies_on_a_synthetic_log() -> None:
    def tokens(mono: float, ids: list[str]) -> dict[str, Any]:
        return {"actor": "scheduler", "seq": 0, "mono": mono, "wall": 100.0 + mono, "type": "TOKENS",
                "step_id": 0, "request_ids": ids, "num_output_tokens": [1] * len(ids)}

    records = [
        {"actor": "frontend", "mono": 0.0, "wall": 100.0, "type": "ARRIVED", "request_id": "a"},
        {"actor": "frontend", "mono": 0.0, "wall": 100.0, "type": "ARRIVED", "request_id": "b"},
        {"actor": "frontend", "mono": 0.0, "wall": 100.0, "type": "ARRIVED", "request_id": "warm"},
        {"actor": "scheduler", "mono": 0.5, "wall": 100.5, "type": "FIRST_TOKEN", "request_id": "a"},
        tokens(0.5, ["a", "warm"]),
        {"actor": "scheduler", "mono": 1.0, "wall": 101.0, "type": "FIRST_TOKEN", "request_id": "b"},
        tokens(1.0, ["a", "b"]),
        tokens(1.25, ["a", "b"]),
    ]
    ttft, itl, seen = request_latencies(records, {"a", "b"})
    assert seen == 2
    assert ttft.count == 2 and ttft.p50 == pytest.approx(0.75) and ttft.max == pytest.approx(1.0)
    assert itl.count == 3 and sorted([itl.p50, itl.max]) == pytest.approx([0.25, 0.5])


def test_report_table_and_json(tmp_path: Path) -> None:
    report = ComparisonReport(config={"model_description": "tiny"})
    report.ours = OursResult(num_requests=2, prompt_tokens=10, output_tokens=20, expected_output_tokens=20,
                             seconds=2.0, enforce_eager=False)
    report.errors["peer"] = "RuntimeError: no GPU"
    table = format_table(report)
    assert "ours: output tok/s" in table and "10" in table and "error: peer" in table
    write_json(report, tmp_path / "results.json")
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["ours"]["tokens_per_s"] == 10.0 and data["floor"] is None and data["peer_ratio"] is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert LatencyStats.of([]).count == 0


def test_the_packages_report_holds_our_engine_alone(tmp_path: Path) -> None:
    from vllm_actors.bench.report import BenchReport

    report = BenchReport(config={"model_description": "tiny"})
    report.ours = OursResult(num_requests=2, prompt_tokens=10, output_tokens=20, expected_output_tokens=20,
                             seconds=2.0, enforce_eager=False)
    write_json(report, tmp_path / "results.json")
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["ours"]["tokens_per_s"] == 10.0 and not {"floor", "peer", "peer_vllm", "batch1_client"} & set(data)
    assert "floor" not in format_table(report)


def test_the_comparisons_are_options_of_the_benchmarks_script_only() -> None:
    """``vllm-actors bench throughput`` runs our engine alone; the floor, peers and --mix are
    ``benchmarks/throughput.py``'s."""
    from benchmarks.lib.throughput_compare import build_parser as script_parser

    from vllm_actors.bench.throughput import build_parser

    for option in (["--peer", "vllm"], ["--no-floor"], ["--mix", "json"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(option)
    args = script_parser().parse_args(["--peer", "vllm", "--no-floor", "--mix", "json", "--num-requests", "4"])
    assert (args.peer, args.no_floor, args.mix, args.num_requests) == (["vllm"], True, "json", 4)
    assert script_parser().parse_args(["--peer", "vllm", "sglang"]).peer == ["vllm", "sglang"]
    assert script_parser().parse_args(["--no-peer"]).peer == ["none"]


def test_shared_prefix_workload_groups_prompts_on_one_prefix_each() -> None:
    """--workload shared-prefix: groups x prompts, each the group's prefix plus a question of its own."""
    from vllm_actors.bench.throughput import build_parser
    from vllm_actors.bench.throughput_workload import make_shared_prefix_workload

    workload = make_shared_prefix_workload(groups=3, per_group=4, prefix_len=10, question_len=5, output_len=7)
    assert len(workload) == 12 and workload.max_tokens == [7] * 12
    assert all(len(prompt) == 15 for prompt in workload.prompts)
    for index, prompt in enumerate(workload.prompts):  # request i is of group i % 3
        assert prompt[:10] == workload.prompts[index % 3][:10]
    assert len({tuple(prompt[:10]) for prompt in workload.prompts}) == 3
    assert len({tuple(prompt[10:]) for prompt in workload.prompts}) == 12
    with pytest.raises(ValueError, match="at least 1"):
        make_shared_prefix_workload(groups=0)
    args = build_parser().parse_args(["--workload", "shared-prefix", "--prefix-groups", "2", "--prefix-len", "8"])
    assert (args.shared_groups, args.shared_prefix_len, args.shared_per_group) == (2, 8, 16)


def test_report_names_the_better_peer_for_each_figure() -> None:
    """Ours against vLLM and SGLang side by side: tok/s against the faster peer, batch-1 times
    against the quicker one, and each peer's ratio."""
    from benchmarks.lib.compare_report import ComparisonReport

    from vllm_actors.bench.report import OursResult

    report = ComparisonReport(config={})
    report.ours = OursResult(num_requests=1, prompt_tokens=10, output_tokens=100, expected_output_tokens=100,
                             seconds=1.0, enforce_eager=False)
    report.batch1_client = {"ttft_s": 0.010, "ms_per_token": 2.0}
    report.peer_vllm = {"tokens_per_s": 80.0, "version": "0.26.0", "output_tokens": 80, "runs": [],
                        "batch1": {"ttft_s": 0.020, "ms_per_token": 2.5}}
    report.peer_sglang = {"tokens_per_s": 125.0, "version": "0.5.17", "output_tokens": 125, "runs": [],
                          "settings": {"attention_backend": "fa3"},
                          "batch1": {"ttft_s": 0.008, "ms_per_token": 2.6}}
    best = report.best_peer
    assert best is not None
    assert best["tokens_per_s"] == {"engine": "sglang", "peer": 125.0, "ours_over_peer": 0.8}
    assert best["ttft_s"]["engine"] == "sglang" and best["ttft_s"]["ours_over_peer"] == pytest.approx(1.25)
    assert best["ms_per_token"]["engine"] == "vllm" and best["ms_per_token"]["ours_over_peer"] == pytest.approx(0.8)
    assert report.vllm_ratio == pytest.approx(1.25) and report.sglang_ratio == pytest.approx(0.8)
    rows = dict(report.comparison_rows())
    assert rows["ours / best peer (tok/s)"] == "0.800 (best: SGLang)"
    assert rows["SGLang: settings"] == "attention_backend=fa3"
    assert report.to_dict()["best_peer"] == best


# --------------------------------------------------------------------------- end to end
def test_main_smoke_on_cpu(tiny_qwen3_config_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.lib.throughput_compare import main

    out = tmp_path / "out"
    status = main([
        "--model", str(tiny_qwen3_config_dir), "--load-format", "dummy",
        "--num-requests", "4", "--max-input-len", "32", "--max-output-len", "8", "--warmup-requests", "1",
        "--no-floor", "--no-peer", "--bandwidth", "3e12", "--matmul-rate", "790e12",
        "--batch1-input-len", "16", "--batch1-output-len", "4", "--batch1-same-engine-only",
        "--out", str(out), "--log-level", "WARNING", "--keep-events", "--trace", str(out / "trace.json"),
    ])
    results = json.loads((out / "results.json").read_text())
    if status != 0 and "load_format" in results["errors"].get("ours", ""):
        pytest.fail(f"the engine does not take load_format='dummy' yet: {results['errors']['ours']}")
    assert status == 0, results["errors"]
    assert results["errors"] == {}
    ours = results["ours"]
    assert ours["num_requests"] == 4 and ours["prompt_tokens"] == 4 * 32
    assert ours["output_tokens"] == ours["expected_output_tokens"] == 4 * 8
    assert ours["tokens_per_s"] > 0
    metrics = results["metrics"]
    assert metrics["log_complete"]
    assert metrics["num_steps"] >= 8 and metrics["num_decode_steps"] >= 1
    assert metrics["ttft"]["count"] == 4 and metrics["itl"]["count"] == 4 * 7
    assert metrics["idle"] is None or 0.0 <= metrics["idle"]["share"] <= 1.0
    assert results["floor"]["output_tokens"] == 32 and results["fraction_of_floor"] > 0
    assert results["ceilings"] is None and results["peer"] is None
    assert set(results["batch1"]) == {"graphs_on"}  # --batch1-same-engine-only: no second engine
    for batch1 in results["batch1"].values():
        assert batch1["output_tokens"] == 4 and batch1["ms_per_token"] > 0
    assert len(results["steps"]) == metrics["num_steps"]
    table = capsys.readouterr().out
    assert "ours: output tok/s" in table and "batch-1 decode, CUDA graphs on" in table
    # --trace: the run's event log (the one --keep-events keeps) as a Chrome trace, every event in it
    with gzip.open(out / "events.jsonl.gz", "rb") as handle:
        rows = [parse_event_json_line(line) for line in handle if line.strip()]
    trace = json.loads((out / "trace.json").read_text())
    events = check_covers(trace, rows)
    assert sum(1 for e in events if e["name"] == "finished") >= 4 + 1  # the warm-up's and the run's
    assert results["config"]["trace"]["path"] == str(out / "trace.json")
    assert results["config"]["trace"]["num_events"] == len(rows) and results["config"]["trace"]["num_left_out"] == 0


@pytest.mark.slow
def test_transformers_peer_api_on_cpu(tiny_qwen3_config_dir: Path) -> None:
    """transformers' continuous batching, driven the way the benchmark drives it on CUDA."""
    pytest.importorskip("transformers")
    from benchmarks.lib.peer_transformers import run_transformers_peer

    workload = make_workload(3, max_input_len=12, max_output_len=5).fit_vocab(512)
    max_tokens = [5, 3, 4]
    result = run_transformers_peer(str(tiny_qwen3_config_dir), workload.prompts, max_tokens, random_weights=True,
                                   device="cpu", capture=False, warmup_requests=1, timeout_s=120,
                                   cb_overrides={"num_blocks": 16, "max_batch_tokens": 64})
    assert result.failed_requests == 0
    assert result.output_tokens == result.expected_output_tokens == 12
    assert result.api == "add_request" and result.tokens_per_s > 0


def test_control_plane_replay_reports_admissions_with_hits() -> None:
    from benchmarks.lib.control_plane import replay

    costs = {caching: replay(num_requests=12, system_tokens=64, steps=6, prefix_caching=caching)
             for caching in (True, False)}
    for steps in costs.values():
        assert len(steps) == 6 and sum(step.num_new for step in steps) == 12
        assert all(step.scheduler_ms >= 0 and step.kv_manager_ms >= 0 for step in steps)
    # With caching the 11 later requests skip the 64 shared tokens (4 blocks of 16).
    computed = {caching: sum(step.num_tokens for step in steps) for caching, steps in costs.items()}
    assert computed[False] - computed[True] == 11 * 64


def test_the_json_penalties_mix_is_one_request_in_ten_constrained() -> None:
    from benchmarks.lib.throughput_mix import MIX_SCHEMA, PENALTIES, mix_fields, our_params

    fields = mix_fields("json-penalties", 256)
    constrained = [index for index, entry in enumerate(fields) if "json" in entry]
    assert constrained == list(range(0, 256, 10)) and json.loads(fields[0]["json"]) == MIX_SCHEMA
    assert all(entry == PENALTIES for entry in fields if "json" not in entry)
    assert mix_fields("none", 3) == [{}, {}, {}]
    alone = mix_fields("json", 30)  # the grammar's cost on its own: the same tenth, the rest plain
    assert [index for index, entry in enumerate(alone) if entry] == [0, 10, 20] and "json" in alone[10]
    assert mix_fields("penalties", 3) == [PENALTIES] * 3
    with pytest.raises(ValueError, match="mix must be one of"):
        mix_fields("jsonish", 3)
    params = our_params(fields[0], 8)
    assert params.structured_outputs is not None and params.ignore_eos and params.max_tokens == 8
    assert our_params(fields[1], 8).repetition_penalty == PENALTIES["repetition_penalty"]


@pytest.mark.slow
def test_mix_smoke_on_cpu(tiny_qwen3: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--mix json-penalties``: the plain and the mixed workload on one engine, every token produced."""
    from benchmarks.lib.throughput_compare import main

    out = tmp_path / "out"
    status = main([
        "--model", str(tiny_qwen3), "--num-requests", "10", "--max-input-len", "16", "--max-output-len", "6",
        "--warmup-requests", "1", "--no-floor", "--no-peer", "--mix", "json-penalties", "--max-model-len", "512",
        "--out", str(out),
        "--log-level", "WARNING",
    ])
    mix = json.loads((out / "mix.json").read_text())
    assert status == 0, mix
    ours = mix["ours"]
    for name in ("plain", "mixed"):
        assert ours[name] and all(run["output_tokens"] == mix["output_tokens"] for run in ours[name]), ours
        assert ours[f"{name}_tokens_per_s"] > 0
    assert "cost" in ours and "mix json-penalties" in capsys.readouterr().out
