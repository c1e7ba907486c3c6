"""Our paged CausalLM against transformers on tiny random Llama and Qwen3 checkpoints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from tests.support.tiny_models import PagedRunner, build_checkpoint
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.hf_loader import load_hf_state_dict, safetensors_files
from vllm_actors.models.llama import CausalLM
from vllm_actors.models.loader import load_model

ATOL = 1e-4
TEXT_A = "The quick brown fox jumps over the lazy dog. Paged attention stores keys and values in blocks."
TEXT_B = "Hello world! What is the capital of France?"
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.fixture(scope="module")
def tiny_llama3_rope(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(
        tmp_path_factory.mktemp("tiny_llama3_rope"), "llama", False, seed=3, rope_scaling=LLAMA3_ROPE
    )


@pytest.fixture(scope="module", params=["tiny_qwen3", "tiny_llama", "tiny_llama3_rope"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


@pytest.fixture(scope="module")
def models(checkpoint: Path) -> tuple[CausalLM, Any, Tokenizer]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ours, _ = load_model(str(checkpoint), torch.float32, torch.device("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    return ours, theirs, tok


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_config_matches_hf(checkpoint: Path) -> None:
    from transformers import AutoConfig

    ours = ModelConfig.from_path(str(checkpoint))
    theirs = AutoConfig.from_pretrained(checkpoint)
    assert ours.source == "hf" and ours.path == str(checkpoint)
    assert ours.architecture == theirs.model_type
    assert ours.qk_norm == (theirs.model_type == "qwen3")
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert (ours.num_hidden_layers, ours.hidden_size, ours.head_dim) == (3, 64, 16)
    assert (ours.num_attention_heads, ours.num_key_value_heads, ours.vocab_size) == (4, 2, 512)
    tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    assert ours.eos_token_ids == [tok.token_to_id("<|im_end|>")]
    assert ours.bos_token_id is None
    assert ours.rope_theta == 10000.0
    if checkpoint.name.startswith("tiny_llama3_rope"):
        assert ours.rope_scaling == LLAMA3_ROPE
    else:
        assert ours.rope_scaling is None
    assert ModelConfig.from_dict(ours.to_dict()) == ours


def test_prefill_then_decode(models: tuple[CausalLM, Any, Tokenizer]) -> None:
    ours, theirs, tok = models
    prompt = tok.encode(TEXT_A).ids
    assert len(prompt) > 20
    runner = PagedRunner(ours, block_size=16, seed=1)
    got = [runner.step({0: prompt})[0]]
    ids = list(prompt)
    for _ in range(5):
        ids.append(int(got[-1][-1].argmax()))
        got.append(runner.step({0: ids[-1:]})[0])
    expected = hf_logits(theirs, ids)
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_chunked_prefill(models: tuple[CausalLM, Any, Tokenizer]) -> None:
    ours, theirs, tok = models
    prompt = tok.encode(TEXT_A + " " + TEXT_B).ids
    runner = PagedRunner(ours, block_size=4, seed=2)
    first = runner.step({7: prompt[:19]})[7]
    second = runner.step({7: prompt[19:]})[7]
    torch.testing.assert_close(torch.cat([first, second]), hf_logits(theirs, prompt), atol=ATOL, rtol=0)


def test_mixed_batch(models: tuple[CausalLM, Any, Tokenizer]) -> None:
    """One step holding a decode, a fresh prefill and a prefill continuation."""
    ours, theirs, tok = models
    a = tok.encode(TEXT_A).ids
    b = tok.encode(TEXT_B).ids
    c = tok.encode(TEXT_B + " " + TEXT_A).ids
    runner = PagedRunner(ours, block_size=8, seed=3)
    runner.step({1: a[:-1], 3: c[:10]})
    out = runner.step({1: a[-1:], 2: b, 3: c[10:]})
    torch.testing.assert_close(out[1], hf_logits(theirs, a)[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out[2], hf_logits(theirs, b), atol=ATOL, rtol=0)
    torch.testing.assert_close(out[3], hf_logits(theirs, c)[10:], atol=ATOL, rtol=0)


def test_greedy_matches_hf_generate(models: tuple[CausalLM, Any, Tokenizer]) -> None:
    ours, theirs, tok = models
    prompt = tok.encode(TEXT_B).ids
    with torch.no_grad():
        ref = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
    runner = PagedRunner(ours, seed=4)
    logits = runner.step({0: prompt})[0]
    generated: list[int] = []
    for _ in range(8):
        generated.append(int(logits[-1].argmax()))
        logits = runner.step({0: generated[-1:]})[0]
    assert generated == ref
    # random weights with std 0.2 make greedy choices decisive, not constant
    assert len(set(generated)) > 1


def test_bfloat16_close_to_float32(tiny_qwen3: Path) -> None:
    ref, _ = load_model(str(tiny_qwen3), torch.float32, torch.device("cpu"))
    low, _ = load_model(str(tiny_qwen3), torch.bfloat16, torch.device("cpu"))
    assert low.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = Tokenizer.from_file(str(tiny_qwen3 / "tokenizer.json")).encode(TEXT_A).ids
    expected = PagedRunner(ref).step({0: prompt})[0]
    got = PagedRunner(low).step({0: prompt})[0]
    assert got.dtype == torch.bfloat16  # logits stay in the model's dtype; the sampler upcasts where it computes
    got = got.float()
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9


def test_weights_and_tying(tiny_qwen3: Path, tiny_llama: Path) -> None:
    assert len(safetensors_files(tiny_llama)) > 1
    assert (tiny_llama / "model.safetensors.index.json").is_file()
    llama_sd = load_hf_state_dict(tiny_llama)
    assert "lm_head.weight" in llama_sd and len(llama_sd) == 2 + 1 + 3 * 9
    qwen_sd = load_hf_state_dict(tiny_qwen3)
    assert len(qwen_sd) == 2 + 3 * 11  # embed + final norm (lm_head tied) + 11 per layer incl. q/k norms

    qwen, _ = load_model(str(tiny_qwen3), torch.float32, torch.device("cpu"))
    assert qwen.lm_head.weight is qwen.model.embed_tokens.weight
    assert torch.equal(qwen.model.layers[1].self_attn.q_norm.weight, qwen_sd["model.layers.1.self_attn.q_norm.weight"])
    llama, _ = load_model(str(tiny_llama), torch.float32, torch.device("cpu"))
    assert llama.lm_head.weight is not llama.model.embed_tokens.weight
    assert torch.equal(llama.lm_head.weight, llama_sd["lm_head.weight"])
    assert llama.model.layers[0].self_attn.q_norm is None

    bad = dict(llama_sd)
    del bad["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        llama.load_weights(bad)


def test_loading_a_model_imports_neither_torchs_compiler_nor_sympy(tiny_llama: Path) -> None:
    """The modules are built on the meta device and given memory off torch's Python references,
    whose first calls import torch._dynamo and sympy: about 3 s of CPU in every worker's start."""
    code = (
        "import sys, torch\n"
        "from vllm_actors.models.loader import load_model\n"
        f"model, _ = load_model({str(tiny_llama)!r}, torch.float32, torch.device('cpu'))\n"
        "assert model.model.layers[0].mlp.gate_up_proj.weight.abs().sum() > 0\n"
        "print(sorted(name for name in ('torch._dynamo', 'sympy') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip() == "[]"


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}')
    with pytest.raises(ValueError, match="DeepseekV3ForCausalLM"):
        ModelConfig.from_path(str(tmp_path))
    with pytest.raises(ValueError, match="longrope"):
        ModelConfig.from_hf_config(
            {
                "model_type": "llama",
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [4.0]},
            }
        )
