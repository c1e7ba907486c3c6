"""The throughput benchmark's options around our run, no engine started: ``--peer-only`` (the engine
peers alone) and ``--engine-env`` (a registered setting for our run only)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.bench.test_throughput_bench import TINY_QWEN3_CONFIG


@pytest.fixture
def tiny_qwen3_config_dir(tmp_path: Path) -> Path:
    """A Hugging Face directory holding only config.json: for load_format="dummy"."""
    path = tmp_path / "tiny-qwen3"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_QWEN3_CONFIG))
    return path


def test_peer_only_runs_the_engine_peers_and_not_ours(tiny_qwen3_config_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``--peer-only --peer vllm``: vLLM's peer on the workload, our engine never started; without an
    engine peer it is refused."""
    from benchmarks.lib import throughput_compare

    from vllm_actors.bench import throughput

    calls: list[str] = []
    peer = {"tokens_per_s": 1.0, "output_tokens": 8}
    monkeypatch.setattr(throughput_compare, "run_engine_peer",
                        lambda engine, *rest: calls.append(engine) or dict(peer))
    monkeypatch.setattr(throughput, "make_llm", lambda *a, **k: pytest.fail("our engine started under --peer-only"))
    common = ["--model", str(tiny_qwen3_config_dir), "--load-format", "dummy", "--num-requests", "2",
              "--max-input-len", "16", "--max-output-len", "4", "--no-floor", "--log-level", "WARNING"]
    out = tmp_path / "out"
    assert throughput_compare.main([*common, "--peer", "vllm", "--peer-only", "--out", str(out)]) == 0
    assert calls == ["vllm"]
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
