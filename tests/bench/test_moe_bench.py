"""The throughput benchmark on mixture-of-experts shapes: the Qwen3-30B-A3B shape (its config as
Qwen ships it, its size), ``--moe-router-skew`` (its value, what the results record, dense models
refused), ``--moe-config`` (a table checked, handed to our engine alone), ``benchmarks/moe_sweep.py``'s
helpers (BLOCK_M candidates up to the hottest expert's rows, the table merged over the current one),
vLLM's peer with the skewed router (a stand-in for vLLM in its own process) and one end-to-end run of
``benchmarks/throughput.py`` on a tiny random Qwen3-MoE with the skew on."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib import moe_sweep
from benchmarks.lib.compare_report import ComparisonReport
from benchmarks.lib.throughput_compare import build_parser, run_engine_peer, run_vllm_peer

from tests.bench.test_bench_serve import _FAKE_VLLM
from tests.bench.test_throughput_bench import TINY_QWEN3_CONFIG
from tests.models.test_router_skew import FAKE_QWEN3_MOE
from vllm_actors.bench.throughput import describe_router_skew
from vllm_actors.bench.throughput_workload import MODEL_SHAPES, make_workload, write_model_dir
from vllm_actors.kernels import moe_config
from vllm_actors.models import registry
from vllm_actors.models.config import ModelConfig

TINY_MOE_CONFIG: dict[str, Any] = {
    **TINY_QWEN3_CONFIG, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

# vLLM's LLM building its Qwen3-MoE blocks (in a worker reached by collective_rpc)
_FAKE_VLLM_MOE = _FAKE_VLLM + '''
import os
from types import SimpleNamespace
import torch
from vllm.model_executor.models import qwen3_moe
_LLM = LLM
class LLM(_LLM):
    def __init__(self, **kw):
        super().__init__(**kw)
        assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork" and os.environ["VLLM_DISABLE_COMPILE_CACHE"] == "1"
        self.model = torch.nn.ModuleList(qwen3_moe.Qwen3MoeSparseMoeBlock((16, 8, 2), prefix=f"model.layers.{i}.mlp")
                                         for i in range(3))
    def collective_rpc(self, method, args=()):
        return [method(SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: self.model)), *args)]
'''


def test_the_qwen3_30b_a3b_shape() -> None:
    """Qwen3-30B-A3B's config.json: every layer sparse, 30.5B parameters (61 GB in bf16)."""
    config = MODEL_SHAPES["qwen3-30b-a3b"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (2048, 48, 32, 4, 128)
    assert (config["rope_theta"], config["max_position_embeddings"], config["vocab_size"]) == (1e6, 40960, 151936)
    model = ModelConfig.from_hf_config(config)
    assert (model.architecture, model.num_experts, model.num_experts_per_tok, model.moe_intermediate_size) == (
        "qwen3_moe", 128, 8, 768)
    assert model.norm_topk_prob and model.moe_layers == tuple(range(48)) and model.qk_norm
    with torch.device("meta"):
        built = registry.model_class(model.architecture)(model)
    parameters = sum(parameter.numel() for parameter in built.parameters())
    assert 30.4e9 < parameters < 30.6e9


def test_the_skew_option(tmp_path: Path) -> None:
    parser = build_parser()
    assert parser.parse_args([]).moe_router_skew is None
    assert parser.parse_args(["--moe-router-skew", "ZIPF:1.20"]).moe_router_skew == "zipf:1.2"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-router-skew", "zipf"])
    args = parser.parse_args(["--moe-router-skew", "zipf:1.2"])
    record = describe_router_skew(args, str(write_model_dir(tmp_path / "moe", MODEL_SHAPES["qwen3-30b-a3b"])))
    assert record is not None and (record["spec"], record["num_experts"], record["top_k"]) == ("zipf:1.2", 128, 8)
    assert record["hottest_over_uniform"] > 10 and record["experts_taking_half_the_choices"] < 16
    assert describe_router_skew(parser.parse_args([]), str(tmp_path / "moe")) is None
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        describe_router_skew(args, str(write_model_dir(tmp_path / "dense", TINY_QWEN3_CONFIG)))


def _table_file(path: Path) -> Path:
    config = moe_config.MoeConfig(16, moe_config.GemmTiles(32, 64), moe_config.GemmTiles(32, 64))
    path.write_text(json.dumps({"format": moe_config.FORMAT, "tables": [{
        "shape": {"experts": 8, "hidden": 64, "intermediate": 32, "top_k": 2}, "dtype": "float32",
        "device": "any", "configs": {"1": config.to_json()}}]}))
    return path


def test_the_moe_config_option(tmp_path: Path) -> None:
    parser = build_parser()
    assert parser.parse_args([]).moe_config is None
    table = _table_file(tmp_path / "table.json")
    assert parser.parse_args(["--moe-config", str(table)]).moe_config == str(table.resolve())
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    for bad in (tmp_path / "absent.json", tmp_path / "bad.json"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--moe-config", str(bad)])


def test_the_sweep_tries_block_m_for_the_hottest_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """At 128 tokens (8 rows per expert on average) uniform routing asks BLOCK_M 16 alone; zipf:1.2's
    hottest expert (~125 rows) adds 32 and 64. The written table keeps the current entries not swept."""
    ids = moe_sweep.routings(128, ["zipf:1.20"], device="cpu")
    assert list(ids) == ["uniform", "zipf:1.2"] and all(i.shape == (128, 8) for i in ids.values())
    hot = moe_sweep.hottest_rows(ids)
    assert hot > 64 and moe_sweep.hottest_rows({"uniform": ids["uniform"]}) < 32
    assert moe_sweep.block_ms(128, moe_sweep.hottest_rows({"uniform": ids["uniform"]})) == [16]
    assert moe_sweep.block_ms(128, hot) == [16, 32, 64]
    old = moe_config.MoeConfig(16, moe_config.GemmTiles(32, 256), moe_config.GemmTiles(128, 128))
    swept = moe_config.MoeConfig(64, moe_config.GemmTiles(64, 64), moe_config.GemmTiles(128, 64)).to_json()
    merged = moe_sweep.merged_table({"128": swept}, {1: old, 128: old, 4096: old})
    assert list(merged) == ["1", "128", "4096"] and merged["128"] == swept and merged["1"] == old.to_json()
    assert moe_sweep.merged_table({"128": swept}, None) == {"128": swept}
    monkeypatch.setenv("OUT", "/lane/part0")
    assert moe_sweep.default_out() == "/lane/part0/moe_sweep"


def test_vllms_peer_skews_its_routers(tmp_path: Path) -> None:
    """peer_vllm.py with --moe-router-skew: the patch installed before LLM(), the table put in every
    worker's gates and counted in the result; SGLang's peer refuses the skew."""
    site = tmp_path / "site" / "vllm"
    (site / "model_executor" / "models").mkdir(parents=True)
    (site / "__init__.py").write_text(_FAKE_VLLM_MOE)
    (site / "model_executor" / "__init__.py").write_text("")
    (site / "model_executor" / "models" / "__init__.py").write_text("")
    (site / "model_executor" / "models" / "qwen3_moe.py").write_text(FAKE_QWEN3_MOE)
    args = build_parser().parse_args(["--peer", "vllm", "--vllm-pythonpath", str(site.parent), "--runs", "1",
                                      "--no-batch1", "--moe-router-skew", "zipf:1.2", "--out", str(tmp_path / "out")])
    Path(args.out).mkdir()
    workload = make_workload(2, max_input_len=8, max_output_len=3)
    result = run_vllm_peer(args, str(tmp_path), "dummy", workload, tmp_path, 151936)
    assert "error" not in result, result.get("error")
    assert result["router_skew"] == {"spec": "zipf:1.2", "skewed_gates_per_worker": [3]}
    rows = dict(ComparisonReport(config={}, peer_vllm=result).comparison_rows())
    assert rows["vLLM: skewed routers"] == "zipf:1.2, [3] per worker"
    with pytest.raises(ValueError, match="vLLM's peer only"):
        run_engine_peer("sglang", args, str(tmp_path), "dummy", workload, tmp_path, 151936)


def test_main_on_a_tiny_moe_with_the_skew(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.lib.throughput_compare import main

    model = write_model_dir(tmp_path / "tiny-moe", TINY_MOE_CONFIG)
    out = tmp_path / "out"
    status = main([
        "--model", str(model), "--load-format", "dummy", "--moe-router-skew", "zipf:1.2",
        "--num-requests", "3", "--max-input-len", "24", "--max-output-len", "6", "--warmup-requests", "1",
        "--no-floor", "--no-peer", "--batch1-input-len", "8", "--batch1-output-len", "3",
        "--batch1-same-engine-only", "--out", str(out), "--log-level", "WARNING",
        "--moe-config", str(_table_file(tmp_path / "table.json")),
    ])
    results = json.loads((out / "results.json").read_text())
    assert status == 0 and results["errors"] == {}, results["errors"]
    assert results["ours"]["output_tokens"] == results["ours"]["expected_output_tokens"] == 3 * 6
    assert results["config"]["moe_router_skew"] == "zipf:1.2"
    assert results["config"]["router_skew"]["num_experts"] == 8 and results["floor"] is None
    assert results["config"]["moe_config"] == str((tmp_path / "table.json").resolve())
    for name in ("VLLM_ACTORS_MOE_ROUTER_SKEW", "VLLM_ACTORS_MOE_CONFIG"):
        assert name not in os.environ  # set for our engine's processes only
    assert re.search(r"experts' routing +\| zipf:1.2: the hottest expert", capsys.readouterr().out)
