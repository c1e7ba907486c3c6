"""GGUF loading of the embedded SmolLM2-135M-Instruct (Q4_1) against transformers' own GGUF loader."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import PagedRunner, build_gguf
from vllm_actors.models.config import ModelConfig, read_gguf_header
from vllm_actors.models.gguf_loader import hf_tensor_name, load_gguf_state_dict, unpermute_qk
from vllm_actors.models.hf_loader import load_hf_state_dict
from vllm_actors.models.llama import CausalLM
from vllm_actors.models.loader import load_model

# ChatML prompt "What is the capital of France?" (default system prompt, generation prompt added),
# as SmolLM2's tokenizer encodes it; hard-coded because building that tokenizer from GGUF takes ~20 s.
CHAT_PROMPT = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
    8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip


@pytest.fixture(scope="module")
def our_model(default_gguf_path: str) -> CausalLM:
    model, _ = load_model(default_gguf_path, torch.float32, torch.device("cpu"))
    return model


def test_config_figures(default_gguf_path: str) -> None:
    c = ModelConfig.from_path(default_gguf_path)
    assert (c.architecture, c.source, c.path) == ("llama", "gguf", default_gguf_path)
    assert c.num_hidden_layers == 30
    assert c.hidden_size == 576
    assert c.intermediate_size == 1536
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and not c.qk_norm
    assert not c.attention_bias and not c.mlp_bias
    assert c.eos_token_ids == [2] and c.bos_token_id == 1


def test_header_types(default_gguf_path: str) -> None:
    header = read_gguf_header(default_gguf_path)
    tensors = header.tensors
    assert len(tensors) == 2 + 30 * 9
    assert "output.weight" not in tensors
    assert tensors["token_embd.weight"].shape == (576, 49152)  # GGUF order: fastest dim first
    from gguf import GGMLQuantizationType as Q

    assert tensors["token_embd.weight"].ggml_type == Q.Q8_0
    assert tensors["blk.0.attn_q.weight"].ggml_type == Q.Q4_1
    assert tensors["blk.0.attn_norm.weight"].ggml_type == Q.F32
    assert header.metadata["tokenizer.ggml.tokens"][2] == "<|im_end|>"


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert hf_tensor_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    with pytest.raises(ValueError, match="ssm_in"):
        hf_tensor_name("blk.0.ssm_in.weight")


def test_unpermute_qk_inverts_llama_cpp_order() -> None:
    heads, head_dim, cols = 3, 8, 5
    w = torch.arange(heads * head_dim * cols, dtype=torch.float32).reshape(heads * head_dim, cols)
    # llama.cpp stores, per head, HF rows in the order 0, D/2, 1, D/2+1, ...
    half = head_dim // 2
    order = [h * head_dim + j * half + i for h in range(heads) for i in range(half) for j in range(2)]
    stored = w[order]
    assert torch.equal(unpermute_qk(stored, heads), w)
    assert torch.equal(unpermute_qk(stored[:, 0], heads), w[:, 0])  # biases too


def test_weights_equal_transformers(default_gguf_path: str, hf_default_gguf_model: Any, our_model: CausalLM) -> None:
    ours = load_gguf_state_dict(default_gguf_path)
    theirs = hf_default_gguf_model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for layer in (0, 17, 29):
        names += [
            f"model.layers.{layer}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj")
        ]
        names += [f"model.layers.{layer}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        names += [f"model.layers.{layer}.{norm}.weight" for norm in ("input_layernorm", "post_attention_layernorm")]
    for name in names:
        assert ours[name].shape == theirs[name].shape, name
        assert torch.equal(ours[name], theirs[name].float()), name
    params = our_model.hf_named_weights()
    for name in names:
        assert torch.equal(params[name], ours[name]), name
    assert our_model.lm_head.weight is our_model.model.embed_tokens.weight


def test_logits_match_transformers(hf_default_gguf_model: Any, our_model: CausalLM) -> None:
    with torch.no_grad():
        expected = hf_default_gguf_model(torch.tensor([CHAT_PROMPT])).logits[0].float()
    runner = PagedRunner(our_model, block_size=16, num_blocks=16, seed=0)
    got = torch.cat(
        [runner.step({0: CHAT_PROMPT[:20]})[0], runner.step({0: CHAT_PROMPT[20:]})[0]]
    )  # chunked prefill across two calls
    scale = expected.abs().max()
    assert (got[-1] - expected[-1]).abs().max() / scale < 1e-3
    assert (got - expected).abs().max() / scale < 1e-3


def test_greedy_answer(default_gguf_path: str, hf_default_gguf_model: Any, our_model: CausalLM) -> None:
    steps = 8
    runner = PagedRunner(our_model, block_size=16, num_blocks=16, seed=1)
    logits = runner.step({0: CHAT_PROMPT})[0]
    generated: list[int] = []
    for _ in range(steps):
        generated.append(int(logits[-1].argmax()))
        logits = runner.step({0: generated[-1:]})[0]
    # transformers, teacher-forced on our continuation, picks the same greedy tokens
    with torch.no_grad():
        ref_logits = hf_default_gguf_model(torch.tensor([CHAT_PROMPT + generated])).logits[0]
    assert ref_logits[len(CHAT_PROMPT) - 1 : -1].argmax(-1).tolist() == generated
    vocab = read_gguf_header(default_gguf_path).metadata["tokenizer.ggml.tokens"]
    text = "".join(vocab[t] for t in generated).replace("\u0120", " ")
    assert "Paris" in text


@pytest.mark.parametrize("hf_fixture", ["tiny_llama", "tiny_qwen3"])
def test_tiny_gguf_round_trip(hf_fixture: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A tiny HF checkpoint written as GGUF (llama.cpp layout) loads back to the same weights and logits."""
    hf_dir = Path(request.getfixturevalue(hf_fixture))
    gguf_path = build_gguf(hf_dir, tmp_path / "tiny.gguf")
    hf_cfg, gguf_cfg = ModelConfig.from_path(str(hf_dir)), ModelConfig.from_path(str(gguf_path))
    # GGUF stores floats as float32: 1e-6 comes back as 9.99999997e-07
    assert gguf_cfg.rms_norm_eps == pytest.approx(hf_cfg.rms_norm_eps, rel=1e-6)
    same = {"source": "gguf", "path": str(gguf_path), "bos_token_id": None, "rms_norm_eps": gguf_cfg.rms_norm_eps}
    assert dataclasses.replace(hf_cfg, **same) == gguf_cfg

    hf_state = load_hf_state_dict(hf_dir)
    gguf_state = load_gguf_state_dict(gguf_path)
    assert set(gguf_state) == set(hf_state)
    for name, tensor in hf_state.items():
        assert torch.equal(gguf_state[name], tensor), name

    ours_hf, _ = load_model(str(hf_dir), torch.float32, torch.device("cpu"))
    ours_gguf, _ = load_model(str(gguf_path), torch.float32, torch.device("cpu"))
    prompt = list(range(3, 40))
    expected = PagedRunner(ours_hf).step({0: prompt})[0]
    torch.testing.assert_close(PagedRunner(ours_gguf).step({0: prompt})[0], expected, atol=1e-5, rtol=0)
