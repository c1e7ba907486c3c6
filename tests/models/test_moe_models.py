"""Mixture-of-experts models on the CPU: tiny random Qwen3-MoE (a dense layer among sparse ones,
top-k not renormalised) and Mixtral (top-2 renormalised) against transformers, through the torch
and the Triton expert paths; experts stacked from their per-expert checkpoint tensors; their TP
shard layout (TP=2 over gloo against TP=1: `test_tensor_parallel_model.py`); the config's fields
and errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import PagedRunner
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.hf_loader import load_hf_state_dict
from vllm_actors.models.llama import MLP, CausalLM
from vllm_actors.models.loader import load_model
from vllm_actors.models.moe import SparseMoeBlock
from vllm_actors.models.parallel import Part, ShardLayout

ATOL = 1e-4


@pytest.fixture(scope="module")
def loaded(tiny_qwen3_moe: Path, tiny_mixtral: Path) -> dict[str, tuple[Path, CausalLM, Any]]:
    """Ours and transformers' model of each checkpoint, loaded once for the module."""
    from transformers import AutoModelForCausalLM

    models = {}
    for name, path in (("tiny_qwen3_moe", tiny_qwen3_moe), ("tiny_mixtral", tiny_mixtral)):
        ours, _ = load_model(str(path), torch.float32, torch.device("cpu"))
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        models[name] = (path, ours, theirs)
    return models


def test_config_reads_the_experts(loaded: dict[str, tuple[Path, CausalLM, Any]]) -> None:
    qwen = ModelConfig.from_path(str(loaded["tiny_qwen3_moe"][0]))
    assert (qwen.architecture, qwen.qk_norm, qwen.num_experts, qwen.num_experts_per_tok) == ("qwen3_moe", True, 4, 2)
    assert (qwen.moe_intermediate_size, qwen.intermediate_size, qwen.norm_topk_prob) == (32, 128, False)
    assert qwen.moe_layers == (0, 2)  # mlp_only_layers [1]
    mixtral = ModelConfig.from_path(str(loaded["tiny_mixtral"][0]))
    assert (mixtral.architecture, mixtral.qk_norm, mixtral.num_experts, mixtral.norm_topk_prob) == (
        "mixtral", False, 4, True)
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size == 32 and mixtral.moe_layers == (0, 1, 2)
    for config in (qwen, mixtral):  # as msgpack hands it over: tuples become lists
        assert ModelConfig.from_dict({**config.to_dict(), "moe_layers": list(config.moe_layers)}) == config
    _, ours, _ = loaded["tiny_qwen3_moe"]
    assert [type(layer.mlp) for layer in ours.model.layers] == [SparseMoeBlock, MLP, SparseMoeBlock]


# the Triton path (Triton's interpreter here: slow) on Mixtral, whose every layer is sparse
@pytest.mark.parametrize(("model", "experts_path"), [("tiny_qwen3_moe", "torch"), ("tiny_mixtral", "torch"),
                                                     ("tiny_mixtral", "triton")])
def test_logits_match_transformers(model: str, experts_path: str, loaded: dict[str, tuple[Path, CausalLM, Any]],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt prefilled in two chunks beside a second one, then decode steps of both in one batch."""
    monkeypatch.setenv("VLLM_ACTORS_FUSED_MOE", experts_path)  # triton: the interpreter on the CPU
    _, ours, theirs = loaded[model]
    a, b = [(7 * i + 3) % 500 for i in range(45)], [(11 * i + 5) % 500 for i in range(20)]
    runner = PagedRunner(ours, block_size=4, seed=5)
    first = runner.step({0: a[:30], 1: b})
    got = {0: [first[0], runner.step({0: a[30:]})[0]], 1: [first[1]]}
    seqs = {0: list(a), 1: list(b)}
    for _ in range(3):
        step = runner.step({seq: [int(got[seq][-1][-1].argmax())] for seq in seqs})
        for seq in seqs:
            seqs[seq].append(int(got[seq][-1][-1].argmax()))
            got[seq].append(step[seq])
    with torch.no_grad():
        for seq, ids in seqs.items():
            want = theirs(torch.tensor([ids])).logits[0]
            torch.testing.assert_close(torch.cat(got[seq]), want, atol=ATOL, rtol=0)


def test_experts_are_stacked_from_their_checkpoint_tensors(loaded: dict[str, tuple[Path, CausalLM, Any]]) -> None:
    path, ours, _ = loaded["tiny_mixtral"]
    state = load_hf_state_dict(path)
    block = ours.model.layers[1].mlp
    assert isinstance(block, SparseMoeBlock) and tuple(block.w13.shape) == (4, 64, 64)
    prefix = "model.layers.1.block_sparse_moe"
    assert torch.equal(block.w13[3, :32], state[f"{prefix}.experts.3.w1.weight"])  # gate
    assert torch.equal(block.w13[3, 32:], state[f"{prefix}.experts.3.w3.weight"])  # up
    assert torch.equal(block.w2[2], state[f"{prefix}.experts.2.w2.weight"])  # down
    assert torch.equal(block.gate.weight, state[f"{prefix}.gate.weight"])
    bad = dict(state)
    del bad[f"{prefix}.experts.0.w3.weight"]
    with pytest.raises(ValueError, match=r"missing \['model.layers.1.block_sparse_moe.experts.0.w3.weight'\]"):
        ours.load_weights(bad)


def test_shard_layout_of_the_experts(loaded: dict[str, tuple[Path, CausalLM, Any]]) -> None:
    config = ModelConfig.from_path(str(loaded["tiny_qwen3_moe"][0]))
    rank1 = ShardLayout(config, 1, 2)
    assert rank1.local_config().moe_intermediate_size == 16
    assert rank1.slice_of("model.layers.0.mlp.experts.3.gate_proj.weight") == Part(0, 16, 32, 32)
    assert rank1.slice_of("model.layers.0.mlp.experts.3.up_proj.weight") == Part(0, 16, 32, 32)
    assert rank1.slice_of("model.layers.0.mlp.experts.3.down_proj.weight") == Part(1, 16, 32, 32)
    assert rank1.slice_of("model.layers.0.mlp.gate.weight") is None  # the router: replicated
    assert rank1.slice_of("model.layers.1.mlp.gate_proj.weight") == Part(0, 64, 128, 128)  # the dense layer
    with pytest.raises(ValueError, match=r"experts' intermediate size \(30\)"):
        ShardLayout(dataclasses.replace(config, moe_intermediate_size=30), 0, 4)


def _hf_config(**changes: Any) -> dict[str, Any]:
    base = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8, "hidden_size": 8,
            "intermediate_size": 8, "moe_intermediate_size": 4, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_experts": 4, "num_experts_per_tok": 2}
    return {**base, **changes}


@pytest.mark.parametrize(("changes", "match"), [
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be between 1 and the number of experts \(4\)"),
    ({"num_experts": None}, "lacks the number of experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be at least 1"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
      "sliding_window": 4, "max_position_embeddings": 64}, "sliding_window 4 is not supported"),
])
def test_config_errors(changes: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(_hf_config(**changes))


def test_decoder_sparse_step() -> None:
    config = ModelConfig.from_hf_config(_hf_config(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert config.moe_layers == (1, 5)  # (i + 1) % 2 == 0, except the MLP-only layer 3
