"""The benchmarks' skewed mixture-of-experts router (models/router_skew.py): its setting, its table
(the same however often it is built), our SparseMoeBlock's expert choices following the Zipf law
under VLLM_ACTORS_MOE_ROUTER_SKEW (and its own routing without it), and vLLM's side
(benchmarks/lib/peer_vllm_skew.py) on a stand-in of vLLM's Qwen3-MoE block choosing exactly as ours."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib import peer_vllm_skew

from vllm_actors.envs import Envs
from vllm_actors.kernels.fused_moe import route
from vllm_actors.models import moe
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.moe import SparseMoeBlock
from vllm_actors.models.router_skew import make_table, parse_skew, skewed_logits

EXPERTS, HIDDEN, TOKENS = 16, 32, 4096
ENV = "VLLM_ACTORS_MOE_ROUTER_SKEW"

# vLLM's Qwen3MoeSparseMoeBlock as far as routing goes: a ReplicatedLinear gate returning (logits, bias),
# called by the block's forward, then the softmax's top-k renormalised (its FusedMoE's router; its
# topk_softmax kernel breaks ties to the lower expert, as a stable sort does: the table's bf16 rows tie).
FAKE_QWEN3_MOE = '''
import torch
from torch import nn

class ReplicatedLinear(nn.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(output_size, input_size))
    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None

class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, vllm_config, prefix=""):
        super().__init__()
        hidden, experts, self.top_k = vllm_config
        self.gate = ReplicatedLinear(hidden, experts)
    def forward(self, hidden_states):
        router_logits, _ = self.gate(hidden_states)
        probs = torch.softmax(router_logits.float(), dim=-1)
        ids = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :self.top_k]
        weights = probs.gather(-1, ids)
        return weights / weights.sum(dim=-1, keepdim=True), ids
'''


def fake_qwen3_moe() -> types.ModuleType:
    module = types.ModuleType("fake_qwen3_moe")
    exec(FAKE_QWEN3_MOE, module.__dict__)
    return module


def tiny_moe_config(top_k: int) -> ModelConfig:
    return ModelConfig.from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": HIDDEN,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16, "num_experts": EXPERTS, "num_experts_per_tok": top_k, "moe_intermediate_size": 8,
        "norm_topk_prob": True,
    })


def choices(block: SparseMoeBlock, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The expert ids the block's router picks for ``x`` (the experts themselves skipped)."""
    picked: list[torch.Tensor] = []
    monkeypatch.setattr(moe, "fused_moe", lambda x, w13, w2, weights, ids, *blocks: picked.append(ids) or x)
    block(x)
    return picked[0]


def make_block(config: ModelConfig, layer: int) -> SparseMoeBlock:
    block = SparseMoeBlock(config, layer)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.02)
    return block


def plackett_luce_marginals(weights: list[float], top_k: int) -> list[float]:
    """Each expert's chance to be among ``top_k`` drawn without replacement (top_k 1 or 2)."""
    if top_k == 1:
        return weights
    return [w + sum(v * w / (1 - v) for j, v in enumerate(weights) if j != e) for e, w in enumerate(weights)]


def test_the_setting_and_its_errors() -> None:
    assert parse_skew("zipf:1.2").spec == "zipf:1.2" and parse_skew(" ZIPF:1.20 ").spec == "zipf:1.2"
    assert parse_skew("zipf:0").weights(4) == [0.25] * 4
    assert Envs({}).VLLM_ACTORS_MOE_ROUTER_SKEW is None
    assert Envs({ENV: "zipf:0.8"}).VLLM_ACTORS_MOE_ROUTER_SKEW == parse_skew("zipf:0.8")
    for bad in ("zipf", "zipf:-1", "uniform", "zipf:1.2x"):
        with pytest.raises(ValueError, match=f"{ENV} must be zipf:S"):
            _ = Envs({ENV: bad}).VLLM_ACTORS_MOE_ROUTER_SKEW


def test_the_table_is_the_same_however_built() -> None:
    skew = parse_skew("zipf:1.2")
    table = make_table(skew, EXPERTS)
    assert torch.equal(table, make_table(skew, EXPERTS))
    assert torch.equal(table, table.to(torch.bfloat16).float())  # held exactly by a bf16 router
    assert not torch.equal(skewed_logits(table, 8, 0, torch.float32), skewed_logits(table, 8, 1, torch.float32))
    assert skewed_logits(table, 8, 1, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("top_k", [1, 2])
def test_our_choices_follow_the_zipf_law(top_k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert e's share of the choices is its Plackett-Luce marginal of the weights (e+1)^-1.2 (a uniform
    router gives every expert 1/16); each layer draws apart, by the same law."""
    config = tiny_moe_config(top_k)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv(ENV, "zipf:1.2")
    expected = torch.tensor(plackett_luce_marginals(parse_skew("zipf:1.2").weights(EXPERTS), top_k)) / top_k
    ids = []
    for layer in (0, 1):
        picked = choices(make_block(config, layer), x, monkeypatch)
        shares = torch.bincount(picked.reshape(-1), minlength=EXPERTS).double() / picked.numel()
        torch.testing.assert_close(shares, expected.double(), atol=0.02, rtol=0)
        ids.append(picked)
    assert (ids[0] != ids[1]).any(dim=-1).float().mean() > 0.5


def test_without_the_setting_the_router_routes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    block = make_block(tiny_moe_config(2), 0)
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(1))
    assert block.router_skew is None
    torch.testing.assert_close(choices(block, x, monkeypatch), route(x @ block.gate.weight.T, 2, True)[1])


def test_vllms_blocks_choose_as_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    """install() wraps the block's __init__: every gate built afterwards gives the table's rows of its
    layer (read from the prefix), so vLLM's router picks exactly our experts, with our weights."""
    module = fake_qwen3_moe()
    skew = parse_skew("zipf:1.2")
    peer_vllm_skew.install(skew, module)
    with pytest.raises(RuntimeError, match="installed already"):
        peer_vllm_skew.install(skew, module)
    monkeypatch.setenv(ENV, "zipf:1.2")
    config = tiny_moe_config(2)
    x = torch.randn(300, HIDDEN, generator=torch.Generator().manual_seed(2))
    model = torch.nn.ModuleList(module.Qwen3MoeSparseMoeBlock((HIDDEN, EXPERTS, 2), prefix=f"model.layers.{i}.mlp")
                                for i in range(3))
    for layer, theirs in enumerate(model):
        assert type(theirs.gate).__name__ == "SkewedReplicatedLinear"
        logits, bias = theirs.gate(x)
        assert bias is None and logits.shape == (300, EXPERTS)
        weights, ids = theirs(x)
        ours = make_block(config, layer)
        assert torch.equal(ids, choices(ours, x, monkeypatch))
        torch.testing.assert_close(weights, route(skewed_logits(ours._skew_table(x.device), 300, layer,
                                                                torch.float32), 2, True)[0])
    with torch.no_grad():
        model[1].gate.router_skew_table.zero_()
    assert peer_vllm_skew.fill_gates(model) == 3  # the workers' step: the table in place again
    assert torch.equal(model[1].gate.router_skew_table, make_table(skew, EXPERTS))
    with pytest.raises(ValueError, match="no layer index"):
        peer_vllm_skew.layer_of("model.mlp")


def test_a_worker_without_skewed_gates_fails_the_run() -> None:
    class Llm:
        def collective_rpc(self, method: Any) -> list[Any]:
            worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2)))
            return [method(worker)]

    with pytest.raises(RuntimeError, match="no skewed router"):
        peer_vllm_skew.fill_in_workers(Llm(), parse_skew("zipf:1"))
