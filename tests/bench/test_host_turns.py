"""The host KV tier benchmark on the CPU: its sizes, vLLM's counters and arguments without vLLM, the
report, ``--append``, and one run of ``benchmarks/host_turns.py`` end to end on a tiny Llama with our
engine in both modes: with the host tier, turn 2 restores turn 1's blocks (pushed out of the pool)
instead of computing them; without it, turn 2 computes its whole prompt; both give the same token."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib import host_turns, host_turns_peer
from benchmarks.lib.host_turns_ours import engine_arguments, token_figures
from benchmarks.lib.host_turns_plan import (
    PROMPT_MARGIN,
    TurnsPlan,
    host_gib_for,
    kv_bytes_per_token,
    plan_turns,
    split_evenly,
)
from benchmarks.lib.host_turns_report import add_result, build_rows, format_markdown, new_report

from tests.bench.test_long_context import TINY_LLAMA3_CONFIG
from vllm_actors.bench.throughput_workload import LLAMA_3_2_1B_CONFIG

GIB = 1 << 30


# --------------------------------------------------------------------------- sizes
def test_the_200k_plan_of_the_llama_1b_shape() -> None:
    per_token = kv_bytes_per_token(LLAMA_3_2_1B_CONFIG, 2)
    assert per_token == 16 * 2 * 8 * 64 * 2  # 16 layers, 8 KV heads of 64, bf16
    plan = plan_turns(204800, 64, 512, 16, per_token)
    assert plan.turn2_prompt + 1 + PROMPT_MARGIN == 204800 == plan.context
    assert plan.turn1_prompt == 204800 - 64 - 512 - 1 - PROMPT_MARGIN
    assert plan.pool_blocks == 16640 and plan.pool_blocks * 16 >= 1.3 * 204800  # turn 1 fits, not twice
    assert plan.filler_lens == (199680, 199680) and plan.filler_tokens >= 1.5 * plan.pool_blocks * 16
    assert all(length + 1 + PROMPT_MARGIN <= plan.context for length in plan.filler_lens)
    kept = (plan.turn2_prompt + plan.filler_tokens) * per_token / GIB
    assert kept * 1.1 <= plan.host_gib < kept * 1.1 + 0.01  # about 20 GiB: turn 1 and the fillers
    assert TurnsPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan_turns(204800, 64, 512, 16, per_token, host_gib=40.0).host_gib == 40.0


def test_plan_refuses_what_cannot_evict_or_fit() -> None:
    with pytest.raises(ValueError, match="pool"):
        plan_turns(4096, 8, 8, 16, 512, pool_factor=0.9)
    with pytest.raises(ValueError, match="pool"):
        plan_turns(4096, 8, 8, 16, 512, filler_factor=1.0)
    with pytest.raises(ValueError, match="no turn-1 prompt"):
        plan_turns(600, 64, 512, 16, 512)
    with pytest.raises(ValueError, match="positive"):
        plan_turns(4096, 8, 8, 16, 512, host_gib=0.0)


def test_split_evenly_and_host_rounding() -> None:
    assert split_evenly(10, 4) == (4, 3, 3) and split_evenly(8, 4) == (4, 4) and split_evenly(3, 10) == (3,)
    with pytest.raises(ValueError):
        split_evenly(0, 4)
    assert host_gib_for(1, 1) == 0.01  # at least one step
    assert host_gib_for(GIB // 1024, 1024) == 1.1  # 1 GiB and 10%
    assert host_gib_for(GIB // 1024 + 1, 1024) == 1.11  # a little more: rounded up to 0.01


# --------------------------------------------------------------------------- the engines' sides
class Counter:  # vLLM's metric classes are told apart by name
    def __init__(self, name: str, value: int, **labels: str) -> None:
        self.name, self.value, self.labels = name, value, {"engine": "0", "model_name": "m", **labels}


class Gauge(Counter):
    pass


def test_vllm_counters_sum_engines_and_name_the_token_sources() -> None:
    source = "vllm:prompt_tokens_by_source"
    metrics = [Counter(source, 100, source="local_compute"), Counter(source, 30, source="local_compute", engine="1"),
               Counter(source, 20, source="local_cache_hit"), Counter(source, 500, source="external_kv_transfer"),
               Counter("vllm:prefix_cache_hits", 520), Gauge("vllm:kv_cache_usage_perc", 1)]
    totals = host_turns_peer.vllm_counters(metrics)
    assert totals[f"{source}{{source=local_compute}}"] == 130 == totals["computed_tokens"]
    assert (totals["restored_tokens"], totals["gpu_hit_tokens"], totals["cached_tokens"]) == (500, 20, 520)
    assert totals["vllm:prefix_cache_hits"] == 520 and "vllm:kv_cache_usage_perc" not in totals
    assert host_turns_peer.vllm_counters([])["computed_tokens"] == 0  # stats off or nothing yet: zeros


def test_each_engine_gets_host_memory_in_host_mode_only(tmp_path: Path) -> None:
    plan = plan_turns(4096, 8, 8, 16, 512).to_dict()
    for mode in ("host", "recompute"):
        plan_path = tmp_path / "plan.json"
        plan_path.write_text(json.dumps(plan))
        args, read = host_turns_peer.parse_args(["--engine", "vllm", "--mode", mode, "--plan", str(plan_path),
                                                 "--model", "m", "--out", "o", "--vocab-size", "512"])
        assert read == plan
        vllm = host_turns_peer.VllmTurns(args, plan).arguments()
        assert (vllm["num_gpu_blocks_override"], vllm["block_size"], vllm["max_model_len"]) == (plan["pool_blocks"],
                                                                                                 16, 4096)
        assert vllm["disable_log_stats"] is False  # get_metrics() needs the stats
        ours = engine_arguments(args, plan)
        assert (ours["num_gpu_blocks_override"], ours["block_size"]) == (plan["pool_blocks"], 16)
        if mode == "host":
            assert (vllm["kv_offloading_size"], vllm["kv_offloading_backend"]) == (plan["host_gib"], "native")
            assert ours["kv_cache_offload_gb"] == plan["host_gib"] > 0
        else:
            assert "kv_offloading_size" not in vllm and ours["kv_cache_offload_gb"] == 0.0
    store = {"prefill_tokens": 39, "prompt_tokens_cached": 544, "kv_blocks_restored": 30, "kv_blocks_offloaded": 2}
    assert token_figures(store, 16) == {"computed_tokens": 39, "cached_tokens": 544, "restored_tokens": 480,
                                        "gpu_hit_tokens": 64, "offloaded_tokens": 32}


def test_the_peer_script_runs_alone_and_records_a_missing_vllm(tmp_path: Path) -> None:
    """Copied to a folder of its own and run without this project on the path, as on the GPU machine."""
    script = tmp_path / "host_turns_peer.py"
    shutil.copyfile(host_turns_peer.__file__, script)
    (tmp_path / "plan.json").write_text(json.dumps(plan_turns(4096, 8, 8, 16, 512).to_dict()))
    assert subprocess.run([sys.executable, "-I", str(script), "--help"], capture_output=True).returncode == 0
    out = tmp_path / "r.json"
    completed = subprocess.run([sys.executable, "-I", str(script), "--engine", "vllm", "--mode", "host", "--plan",
                                str(tmp_path / "plan.json"), "--model", "m", "--out", str(out), "--vocab-size", "512"],
                               capture_output=True, text=True)
    assert completed.returncode != 0 and "vllm" in json.loads(out.read_text())["error"]


# --------------------------------------------------------------------------- the report
def _result(turn1: float, turn2: list[float], restored: int, computed: int, tokens: list[int]) -> dict[str, Any]:
    cycles = [{"turn1": {"ttft_s": turn1 / 1e3, "e2e_s": 2 * turn1 / 1e3},
               "turn2": {"ttft_s": t / 1e3, "prompt_len": 900, "token": token},
               "counters": {"turn2": {"computed_tokens": computed, "restored_tokens": restored, "gpu_hit_tokens": 0,
                                      "cached_tokens": restored}}} for t, token in zip(turn2, tokens, strict=True)]
    return {"startup_s": 3.0, "cycles": cycles, "summary": host_turns_peer.summarize(cycles)}


def test_report_compares_each_mode_with_recompute_and_ours_with_vllm() -> None:
    report = new_report({"model_description": "llama-3.2-1b shape", "dtype": "bfloat16",
                         "plan": plan_turns(204800, 64, 512, 16, 32768).to_dict()})
    add_result(report, "ours", "host", _result(7000, [300, 320, 310], 204544, 239, [5, 6, 7]), "ours-host.log", None)
    add_result(report, "ours", "recompute", _result(7100, [7000, 7200, 7100], 0, 204783, [5, 6, 7]),
               "ours-recompute.log", None)
    add_result(report, "vllm", "host", {"error": "startup: ValueError: no connector"}, "vllm-host.log", "exit 1: boom")
    add_result(report, "vllm", "recompute", _result(6900, [6800, 6900, 7000], 0, 204783, [1, 2, 4]),
               "vllm-recompute.log", None)
    build_rows(report)
    rows = {(row["engine"], row["mode"]): row for row in report["rows"]}
    ours = rows["ours", "host"]
    assert ours["turn2_ttft_ms"] == 310 and ours["turn2_ttft_ms_samples"] == [300, 320, 310]
    assert ours["vs_recompute"] == pytest.approx(310 / 7100) and ours["same_token"] is True
    assert ours["ours_vs_vllm"] is None  # vLLM's offloading failed
    assert rows["ours", "recompute"]["ours_vs_vllm"] == pytest.approx(7100 / 6900)
    assert rows["ours", "recompute"]["vs_recompute"] is None
    assert rows["vllm", "host"]["error"] == "exit 1: boom" and report["errors"] == {"vllm/host": "exit 1: boom"}
    table = format_markdown(report)
    assert ("| ours | host KV tier | 7,000.0 | 310.0 | 300.0, 320.0, 310.0 | 204,544 | 0 | 239 | 0.0437 | - | yes |"
            in table)
    assert "| vllm | CPU offloading | exit 1: boom |" in table and "200k-token conversation" in table
    assert "2 prompts, 399,360 tokens" in table and "vllm/host failed: exit 1: boom" in table

    # a later run of vLLM's offloading that works replaces the failure; a different token is flagged
    add_result(report, "vllm", "host", _result(6900, [900, 950, 1000], 204544, 239, [1, 2, 3]), "vllm-host-2.log", None)
    build_rows(report)
    rows = {(row["engine"], row["mode"]): row for row in report["rows"]}
    assert report["errors"] == {} and rows["ours", "host"]["ours_vs_vllm"] == pytest.approx(310 / 950)
    assert rows["vllm", "host"]["same_token"] is False and "| NO |" in format_markdown(report)


def test_append_adds_engines_and_refuses_other_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA3_CONFIG))
    ran: list[tuple[str, str]] = []

    def fake_run_engine(args: Any, engine: str, mode: str, *rest: Any) -> tuple[dict[str, Any], str, str | None]:
        ran.append((engine, mode))
        return _result(10, [5], 64, 8, [3]), f"{engine}-{mode}.log", None

    monkeypatch.setattr(host_turns, "run_engine", fake_run_engine)
    argv = ["--model", str(model), "--context", "600", "--turn-output", "8", "--new-tokens", "32",
            "--out", str(tmp_path / "out")]
    assert host_turns.main([*argv, "--engines", "ours"]) == 0
    assert host_turns.main([*argv, "--engines", "vllm", "--modes", "host", "--append"]) == 0
    assert ran == [("ours", "host"), ("ours", "recompute"), ("vllm", "host")]
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(report["results"]) == {"ours/host", "ours/recompute", "vllm/host"}
    with pytest.raises(SystemExit, match="other settings"):
        host_turns.main([*argv[:-2], "--new-tokens", "16", "--out", str(tmp_path / "out"), "--append"])


# --------------------------------------------------------------------------- end to end
def test_our_engine_restores_the_evicted_prefix_with_the_tier_and_recomputes_it_without(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "tiny-llama3"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_LLAMA3_CONFIG))
    out = tmp_path / "out"
    argv = ["--model", str(model), "--load-format", "dummy", "--dtype", "float32", "--engines", "ours",
            "--context", "600", "--turn-output", "8", "--new-tokens", "32", "--repeats", "2", "--out", str(out)]
    status = host_turns.main(argv)
    assert status == 0, [(out / f"ours-{mode}.log").read_text()[-3000:] for mode in ("host", "recompute")]
    report = json.loads((out / "results.json").read_text())
    plan = report["config"]["plan"]
    assert plan["pool_blocks"] == 49 and plan["filler_tokens"] >= 1.5 * 49 * 16 and 0 < plan["host_gib"] < 0.1
    prefix_blocks = (plan["turn1_prompt"] + plan["turn_output"]) // 16  # turn 1's full blocks, output included
    for mode in ("host", "recompute"):
        result = report["results"][f"ours/{mode}"]
        settings = report["runs"][result["run"]]["settings"]
        assert settings["scheduler_config"]["num_blocks"] == 49
        assert settings["scheduler_config"]["num_host_blocks"] > 0 if mode == "host" else \
            settings["scheduler_config"]["num_host_blocks"] == 0
        for cycle in result["cycles"]:
            assert cycle["counters"]["turn1"]["cached_tokens"] == 0, "every cycle's turn 1 is a fresh prompt"
            turn2 = cycle["counters"]["turn2"]
            assert turn2["gpu_hit_tokens"] == 0, "the fillers pushed turn 1 out of the GPU pool"
            if mode == "host":
                assert turn2["kv_blocks_restored"] == prefix_blocks and turn2["restored_tokens"] == prefix_blocks * 16
                assert turn2["computed_tokens"] == plan["turn2_prompt"] - prefix_blocks * 16 < plan["turn2_prompt"]
            else:
                assert turn2["kv_blocks_restored"] == 0 and turn2["kv_blocks_offloaded"] == 0
                assert turn2["computed_tokens"] == plan["turn2_prompt"]
    rows = {row["mode"]: row for row in report["rows"]}
    assert rows["host"]["same_token"] is True, "a restored prefix gives the token a recomputed one does"
    assert rows["host"]["turn2_ttft_ms"] > 0 and rows["host"]["vs_recompute"] > 0
    table = (out / "host_turns.md").read_text()
    assert "| ours | host KV tier |" in table and "| ours | no tier: recompute |" in table
    assert table in capsys.readouterr().out
