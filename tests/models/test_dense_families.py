"""Qwen2, Mistral, Gemma 2 and Gemma 3's text model against transformers on tiny random checkpoints
(transformers' own classes), in-process: logits through a paged cache in chunks longer than the
sliding windows, then decode; and the config readings of both transformers spellings."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_families import FAMILIES
from tests.support.tiny_models import PagedRunner, build_checkpoint
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.llama import DictSource
from vllm_actors.models.loader import load_model

ATOL = 2e-4
SHAPES: dict[str, dict[str, int]] = {"gemma3_text": {"num_hidden_layers": 6}}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    path = build_checkpoint(tmp_path_factory.mktemp(f"tiny_{arch}"), arch, tie_word_embeddings=arch != "qwen2",
                            seed=7, shape=SHAPES.get(arch))  # fmt: skip
    return arch, path


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    # eager: transformers' SDPA path drops Gemma 2's attention soft cap
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def paged_logits(model: Any, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Prefill in chunks of the given sizes, then one token a step."""
    runner = PagedRunner(model, block_size=4, num_blocks=128)
    out, start = [], 0
    for size in chunks:
        out.append(runner.step({0: ids[start : start + size]})[0])
        start += size
    out += [runner.step({0: [token]})[0] for token in ids[start:]]
    return torch.cat(out)


def test_logits_match_transformers(family: tuple[str, Path]) -> None:
    arch, path = family
    ours, config = load_model(str(path), torch.float32, torch.device("cpu"))
    assert config.architecture == arch
    theirs = hf_model(path)
    ids = torch.randint(0, config.vocab_size, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0]
    got = paged_logits(ours, ids, [30, 25])  # chunks and a context far past every window
    assert (got - expected).abs().max().item() < ATOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    if config.sliding_window is not None:  # the window matters in this test: without it, other logits
        for layer in ours.model.layers:
            layer.self_attn.sliding_window = None
        assert (paged_logits(ours, ids, [30, 25]) - expected).abs().max().item() > 1e-2


def test_triton_kernels_in_the_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Gemma 2 (windows of 8 and soft caps in every layer) on the Triton varlen and decode kernels."""
    pytest.importorskip("triton")
    from vllm_actors.kernels.triton_attention import INTERPRET, TritonPagedAttention

    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("Triton's interpreter was not enabled before the kernels were imported")
    path = build_checkpoint(tmp_path, "gemma2", tie_word_embeddings=True, seed=8, shape={"num_hidden_layers": 2})
    ours, config = load_model(str(path), torch.float32, torch.device("cpu"))
    ours.attn_backend = TritonPagedAttention()
    ids = torch.randint(0, config.vocab_size, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([ids])).logits[0]
    assert (paged_logits(ours, ids, [13, 6]) - expected).abs().max().item() < ATOL


BASE: dict[str, Any] = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
}  # fmt: skip


def test_config_spellings() -> None:
    # Gemma 3 as transformers 4 wrote it: rope_theta, rope_scaling (global layers),
    # rope_local_base_freq, sliding_window_pattern; no layer_types, no tie_word_embeddings
    gemma3 = ModelConfig.from_hf_config({
        **BASE, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "rope_theta": 1e6,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "rope_local_base_freq": 1e4,
        "sliding_window": 512, "sliding_window_pattern": 3, "query_pre_attn_scalar": 256,
    })  # fmt: skip
    assert gemma3.tie_word_embeddings and gemma3.gemma_norms and gemma3.qk_norm
    assert (gemma3.rope_theta, gemma3.rope_scaling, gemma3.local_rope_theta) == (1e6, {"rope_type": "linear",
                                                                                        "factor": 8.0}, 1e4)
    assert [gemma3.layer_sliding_window(i) for i in range(6)] == [512, 512, None, 512, 512, None]
    assert gemma3.attention_scale == 256**-0.5 and gemma3.embed_scale == 32**0.5
    # Gemma 2's default: every other layer, the first sliding
    gemma2 = ModelConfig.from_hf_config({**BASE, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                                         "sliding_window": 4096, "attn_logit_softcapping": 50.0})
    assert [gemma2.layer_sliding_window(i) for i in range(3)] == [4096, None, 4096]
    assert gemma2.attn_logit_softcapping == 50.0 and gemma2.hidden_activation == "gelu_pytorch_tanh"
    # Qwen2.5 ships use_sliding_window false with a window size: no window; Qwen2's q/k/v bias
    qwen = ModelConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                                       "use_sliding_window": False, "sliding_window": 131072,
                                       "max_window_layers": 3})  # fmt: skip
    assert qwen.qkv_bias and qwen.layer_sliding_window(5) is None
    # Mistral v0.1's window on every layer; later releases set none
    mistral = {**BASE, "architectures": ["MistralForCausalLM"], "model_type": "mistral"}
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": 4096}).layer_sliding_window(3) == 4096
    assert ModelConfig.from_hf_config({**mistral, "sliding_window": None}).layer_sliding_window(3) is None
    assert ModelConfig.from_dict(gemma3.to_dict()) == gemma3
    with pytest.raises(ValueError, match="hidden_activation"):
        ModelConfig.from_hf_config({**BASE, "model_type": "gemma2", "hidden_activation": "relu"})
    with pytest.raises(ValueError, match="layer_types"):
        dataclasses.replace(gemma3, layer_types=["full_attention"])


def test_phi3_fused_projections_by_rank(tmp_path: Path) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj are read by rows as their parts: rank 1 of 2 holds q
    rows 32..63, its KV head's k and v rows 16..31 and up rows 64..127 of the whole model's."""
    from vllm_actors.models.fused_names import SplitFusedSource
    from vllm_actors.models.parallel import TensorParallel

    path = build_checkpoint(tmp_path, "phi3", tie_word_embeddings=False, seed=3, shape={"num_hidden_layers": 1})
    whole = load_model(str(path), torch.float32, torch.device("cpu"))[0].hf_named_weights()
    rank, config = load_model(str(path), torch.float32, torch.device("cpu"), tp=TensorParallel(rank=1, size=2))
    part = rank.hf_named_weights()
    for name, rows in (("self_attn.q_proj", slice(32, 64)), ("self_attn.k_proj", slice(16, 32)),
                       ("self_attn.v_proj", slice(16, 32)), ("mlp.up_proj", slice(64, 128))):
        key = f"model.layers.0.{name}.weight"
        assert torch.equal(part[key], whole[key][rows]), name
    short = {"model.layers.0.self_attn.qkv_proj.weight": torch.zeros(10, 64)}
    with pytest.raises(ValueError, match="10 rows, expected 128"):
        SplitFusedSource(DictSource(short), config)
