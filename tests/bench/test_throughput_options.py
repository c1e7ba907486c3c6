"""The throughput benchmark's options around our run, no engine started: ``--peer-only`` (the engine
peers alone), ``--engine-env`` (a registered setting for our run only) and ``--pipeline-parallel-size``
(to our engine, the peers and the floor)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest


def test_peer_only_runs_the_engine_peers_and_not_ours(tiny_qwen3_config_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--peer-only --peer vllm``: vLLM's peer on the workload, our engine never started; without an
    engine peer it is refused."""
    from benchmarks.lib import throughput_compare

    from vllm_actors.bench import throughput

    calls: list[tuple[str, int]] = []
    peer = {"tokens_per_s": 1.0, "output_tokens": 8}
    monkeypatch.setattr(throughput_compare, "run_engine_peer",
                        lambda engine, args, *rest: calls.append((engine, args.pipeline_parallel_size)) or dict(peer))
    monkeypatch.setattr(throughput, "make_llm", lambda *a, **k: pytest.fail("our engine started under --peer-only"))
    common = ["--model", str(tiny_qwen3_config_dir), "--load-format", "dummy", "--num-requests", "2",
              "--max-input-len", "16", "--max-output-len", "4", "--no-floor", "--log-level", "WARNING"]
    out = tmp_path / "out"
    assert throughput_compare.main([*common, "--peer", "vllm", "--peer-only", "-pp", "2", "--out", str(out)]) == 0
    assert calls == [("vllm", 2)]
    assert json.loads((out / "results.json").read_text())["peer_vllm"] == peer
    with pytest.raises(SystemExit, match="--peer-only needs an engine peer"):
        throughput_compare.main([*common, "--no-peer", "--peer-only", "--out", str(tmp_path / "none")])


def test_engine_env_sets_a_registered_setting_for_our_run_only(tiny_qwen3_config_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``--engine-env NAME=VALUE``: parsed by the setting's own parser (an unknown name or a bad value is
    refused), in the environment while our engine runs, the earlier value back after it."""
    from benchmarks.lib import throughput_compare

    from vllm_actors.bench import throughput

    parser = throughput_compare.build_parser()
    args = parser.parse_args(["--engine-env", "VLLM_ACTORS_FP8_GEMV_SILU=1", "--engine-env", "VLLM_ACTORS_PDL=0"])
    assert args.engine_env == [("VLLM_ACTORS_FP8_GEMV_SILU", "1"), ("VLLM_ACTORS_PDL", "0")]
    for bad in ("VLLM_ACTORS_NO_SUCH=1", "VLLM_ACTORS_FP8_GEMV_ROWS=many", "VLLM_ACTORS_PDL"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--engine-env", bad])
    seen: list[str | None] = []
    monkeypatch.setenv("VLLM_ACTORS_PDL", "1")
    monkeypatch.delenv("VLLM_ACTORS_FP8_GEMV_SILU", raising=False)
    monkeypatch.setattr(throughput, "_run_ours", lambda *a: seen.extend(
        [os.environ.get("VLLM_ACTORS_FP8_GEMV_SILU"), os.environ.get("VLLM_ACTORS_PDL")]) or False)
    throughput_compare.main(["--model", str(tiny_qwen3_config_dir), "--load-format", "dummy", "--num-requests", "2",
                             "--max-input-len", "16", "--max-output-len", "4", "--no-floor", "--no-peer",
                             "--log-level", "WARNING", "--out", str(tmp_path / "out"),
                             "--engine-env", "VLLM_ACTORS_FP8_GEMV_SILU=1", "--engine-env", "VLLM_ACTORS_PDL=0"])
    assert seen == ["1", "0"]
    assert "VLLM_ACTORS_FP8_GEMV_SILU" not in os.environ and os.environ["VLLM_ACTORS_PDL"] == "1"


# --------------------------------------------------------------------------- pipeline parallelism
def test_pipeline_parallel_size_is_parsed_and_below_one_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.lib import throughput_compare

    parser = throughput_compare.build_parser()
    assert parser.parse_args([]).pipeline_parallel_size == 1
    args = parser.parse_args(["-pp", "2", "-tp", "2"])
    assert (args.pipeline_parallel_size, args.tensor_parallel_size) == (2, 2)
    assert parser.parse_args(["--pipeline-parallel-size", "3"]).pipeline_parallel_size == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["-pp", bad])
        assert "--pipeline-parallel-size" in capsys.readouterr().err


def test_pipeline_parallel_size_reaches_our_engine_with_tensor_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    """``make_llm`` passes PP (with TP) to ``LLM``; PP=1 is left at the engine's default; a Namespace
    with PP below 1 (the API, past argparse) is a ValueError naming the flag."""
    from vllm_actors import llm as llm_module
    from vllm_actors.bench import throughput
    from vllm_actors.bench.throughput_engine import make_llm

    seen: list[dict[str, Any]] = []
    monkeypatch.setattr(llm_module, "LLM", lambda **kwargs: seen.append(kwargs) or "llm")
    parser = throughput.build_parser()
    assert make_llm(parser.parse_args(["-pp", "2", "-tp", "2"]), "/m", "dummy", enforce_eager=True) == "llm"
    assert seen[0]["pipeline_parallel_size"] == 2 and seen[0]["tensor_parallel_size"] == 2
    make_llm(parser.parse_args([]), "/m", "dummy", enforce_eager=True)
    assert "pipeline_parallel_size" not in seen[1]
    bad = parser.parse_args([])
    bad.pipeline_parallel_size = 0
    with pytest.raises(ValueError, match="--pipeline-parallel-size must be at least 1"):
        make_llm(bad, "/m", "dummy", enforce_eager=True)
    record = throughput._config_record(parser.parse_args(["-pp", "2", "-tp", "2"]), "dummy",
                                       throughput.make_workload(2, 16, 4))
    assert record["pipeline_parallel_size"] == 2 and record["model_description"].endswith("TP=2, PP=2")


def test_pipeline_parallel_size_reaches_the_peers(tiny_qwen3_config_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer's command line carries ``--pipeline-parallel-size``; vLLM's ``LLM`` gets it with the
    ``mp`` executor, SGLang's ``Engine`` as ``pp_size``; PP=1 adds neither."""
    from benchmarks.lib import peer_common, peer_sglang, peer_vllm, throughput_compare

    from vllm_actors.bench.throughput import make_workload

    commands: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="")

    monkeypatch.setattr(throughput_compare.subprocess, "run", fake_run)
    args = throughput_compare.build_parser().parse_args(["-pp", "2", "-tp", "2", "--out", str(tmp_path)])
    throughput_compare.run_engine_peer("vllm", args, str(tiny_qwen3_config_dir), "dummy", make_workload(2, 16, 4),
                                       tmp_path, 512)
    command = commands[0]
    assert command[command.index("--pipeline-parallel-size") + 1] == "2"
    assert command[command.index("--tensor-parallel-size") + 1] == "2"

    def peer_args(*extra: str) -> argparse.Namespace:
        parser = peer_common.common_arguments(argparse.ArgumentParser())
        parser.add_argument("--attention-backend", default="fa3")
        return parser.parse_args(["--model", "/m", "--workload", "w.json", "--out", "r.json", *extra])

    staged = peer_vllm.llm_kwargs(peer_args(*command[command.index("--tensor-parallel-size"):][:4]), False)
    assert staged["pipeline_parallel_size"] == 2 and staged["tensor_parallel_size"] == 2
    assert staged["distributed_executor_backend"] == "mp"
    plain = peer_vllm.llm_kwargs(peer_args(), False)
    assert "pipeline_parallel_size" not in plain and "distributed_executor_backend" not in plain
    assert peer_sglang.engine_kwargs(peer_args("--pipeline-parallel-size", "2"), False)["pp_size"] == 2
    assert "pp_size" not in peer_sglang.engine_kwargs(peer_args(), False)


def test_floor_splits_kv_and_flops_over_every_gpu_and_weights_over_tp() -> None:
    """PP x TP GPUs: a decode step's weights take weights / TP / bandwidth (each stage reads its
    share once per micro-batch, PP of them), its KV cache / (PP x TP); the prefill's FLOPs / (PP x TP)."""
    from benchmarks.lib.floor import ModelShape, workload_floor

    shape = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1,
                       num_kv_heads=1, head_dim=4, tie_word_embeddings=True)
    weights, kv = shape.weight_bytes_per_step, shape.kv_bytes_per_token
    one = workload_floor([3, 5], [3, 2], shape, bandwidth=1.0, matmul_rate=1.0, max_num_seqs=1)
    split = workload_floor([3, 5], [3, 2], shape, bandwidth=1.0, matmul_rate=1.0, max_num_seqs=1,
                           tensor_parallel_size=2, pipeline_parallel_size=3)
    assert split.prefill_seconds == pytest.approx(one.prefill_seconds / 6)
    memory_bound = workload_floor([3, 5], [3, 2], shape, bandwidth=1.0, matmul_rate=1e30,
                                  tensor_parallel_size=2, pipeline_parallel_size=3)
    assert memory_bound.decode_seconds == pytest.approx((weights / 2 + 10 * kv / 6) + (weights / 2 + 5 * kv / 6))
    assert (memory_bound.tensor_parallel_size, memory_bound.pipeline_parallel_size) == (2, 3)
    assert memory_bound.bandwidth == 1.0  # one GPU's, as measured
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        workload_floor([3], [3], shape, bandwidth=1.0, matmul_rate=1.0, pipeline_parallel_size=0)
