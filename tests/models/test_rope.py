"""RoPE scaling: config parsing in both transformers spellings, frequencies against transformers'
``ROPE_INIT_FUNCTIONS``, cos/sin accuracy near position 1,000,000, and the max_model_len limit."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_actors.kernels.fused_ops import qk_norm_rope_torch
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.rope import RotaryFrequencies, rope_cos_sin, rope_frequencies
from vllm_actors.models.rope_config import derived_max_model_len, normalize_rope_scaling
from vllm_actors.protocol.config import EngineConfig, resolve_scheduler_config

LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
QWEN3_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}

# (name, rope parameters, theta, head_dim, max_position_embeddings)
CASES: list[tuple[str, dict[str, Any], float, int, int]] = [
    ("llama3", LLAMA31, 500000.0, 64, 131072),
    ("yarn", QWEN3_YARN, 1000000.0, 128, 131072),
    ("yarn-betas", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                    "beta_fast": 16, "beta_slow": 2, "truncate": False}, 10000.0, 64, 32768),
    ("yarn-mscale", {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "mscale": 1.0, "mscale_all_dim": 0.707}, 10000.0, 64, 163840),
    ("yarn-attention-factor", {"rope_type": "yarn", "factor": 2.0, "attention_factor": 0.9,
                               "original_max_position_embeddings": 2048}, 10000.0, 96, 4096),
    ("linear", {"rope_type": "linear", "factor": 4.0}, 10000.0, 128, 4096),
    ("dynamic", {"rope_type": "dynamic", "factor": 2.0}, 10000.0, 80, 4096),
]


def _hf_config(arch: str, rope: dict[str, Any], theta: float, head_dim: int, max_positions: int) -> Any:
    from transformers import LlamaConfig, Qwen3Config

    cls = LlamaConfig if arch == "llama" else Qwen3Config
    return cls(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
               num_hidden_layers=1, intermediate_size=64, vocab_size=32, max_position_embeddings=max_positions,
               rope_parameters={**rope, "rope_theta": theta})


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_frequencies_match_transformers(case: tuple[str, dict[str, Any], float, int, int]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, rope, theta, head_dim, max_positions = case
    hf = _hf_config("llama", rope, theta, head_dim, max_positions)
    ours = rope_frequencies(ModelConfig.from_hf_config(hf.to_dict()))
    # dynamic: transformers recomputes per length; ours is its value at max_position_embeddings * factor
    seq_len = int(max_positions * rope["factor"]) if rope["rope_type"] == "dynamic" else None
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu", seq_len=seq_len)
    assert ours.inv_freq.dtype == torch.float64 and ours.inv_freq.shape == (head_dim // 2,)
    torch.testing.assert_close(ours.inv_freq, inv_freq.double(), rtol=2e-6, atol=0)
    assert ours.attention_factor == pytest.approx(attention_factor, rel=1e-12)
    if rope["rope_type"] == "yarn":
        assert ours.attention_factor != 1.0  # the mscale is exercised


def test_dynamic_uses_vllms_fixed_base() -> None:
    """dynamic: base * (factor * factor - (factor - 1)) ** (dim / (dim - 2)) at any length (vLLM's)."""
    config = ModelConfig.from_hf_config(_hf_config("llama", {"rope_type": "dynamic", "factor": 3.0},
                                                   10000.0, 64, 2048).to_dict())
    base = 10000.0 * (3.0 * 3.0 - 2.0) ** (64 / 62)
    expected = [1.0 / base ** (i / 64) for i in range(0, 64, 2)]
    torch.testing.assert_close(rope_frequencies(config).inv_freq, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("arch,rope", [("llama", LLAMA31), ("qwen3", QWEN3_YARN)])
def test_both_config_spellings_read_the_same(arch: str, rope: dict[str, Any], tmp_path: Path) -> None:
    """transformers 5 writes ``rope_parameters`` (with rope_theta inside); transformers 4 wrote
    ``rope_scaling`` (rope_type or its older key ``type``) beside a top-level ``rope_theta``."""
    import json

    _hf_config(arch, rope, 1000000.0, 16, 131072).save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_scaling" not in written and "rope_theta" not in written
    assert written["rope_parameters"]["rope_type"] == rope["rope_type"]
    v5 = ModelConfig.from_path(str(tmp_path))
    legacy = {k: v for k, v in rope.items() if k != "rope_type"} | {"type": rope["rope_type"]}
    v4 = {k: v for k, v in written.items() if k != "rope_parameters"}
    v4.update(rope_scaling=legacy, rope_theta=1000000.0)
    assert ModelConfig.from_hf_config(v4, path=str(tmp_path)) == v5
    assert v5.rope_theta == 1000000.0 and v5.rope_scaling is not None
    assert {k: v5.rope_scaling[k] for k in rope} == rope
    assert ModelConfig.from_dict(v5.to_dict()) == v5


def test_plain_rope_and_bad_scaling() -> None:
    assert normalize_rope_scaling({"rope_type": "default", "rope_theta": 1e4}, 4096) is None
    assert normalize_rope_scaling(None, 4096) is None
    yarn = normalize_rope_scaling({"rope_type": "yarn", "factor": 4.0}, 8192)  # original: max_position_embeddings
    assert yarn is not None and yarn["original_max_position_embeddings"] == 8192 and yarn["beta_fast"] == 32.0
    top_level = normalize_rope_scaling(QWEN3_YARN, 65536, original_max_position_embeddings=16384)
    assert top_level is not None and top_level["original_max_position_embeddings"] == 16384
    with pytest.raises(ValueError, match="unsupported rope scaling type 'longrope'.*yarn"):
        normalize_rope_scaling({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, 4096)
    with pytest.raises(ValueError, match="factor"):
        normalize_rope_scaling({"rope_type": "linear"}, 4096)
    with pytest.raises(ValueError, match="missing"):
        normalize_rope_scaling({"rope_type": "llama3", "factor": 8.0}, 4096)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        normalize_rope_scaling({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, 4096)


def test_derived_max_model_len_follows_vllm() -> None:
    assert derived_max_model_len(4096, None) == 4096
    assert derived_max_model_len(131072, normalize_rope_scaling(LLAMA31, 131072)) == 131072  # already extended
    assert derived_max_model_len(40960, normalize_rope_scaling(QWEN3_YARN, 40960)) == 131072  # original * factor
    assert derived_max_model_len(4096, normalize_rope_scaling({"rope_type": "linear", "factor": 4}, 4096)) == 16384
    assert derived_max_model_len(4096, normalize_rope_scaling({"rope_type": "dynamic", "factor": 2}, 4096)) == 8192


def test_max_model_len_beyond_the_limit_is_an_error_unless_allowed() -> None:
    config = EngineConfig(model="m", max_model_len=131073, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match=r"max_model_len \(131073\) is greater than the derived max_model_len "
                                         r"\(131072.*VLLM_ACTORS_ALLOW_LONG_MAX_MODEL_LEN=1"):
        resolve_scheduler_config(config, 131072, num_blocks=1 << 20)
    allowed = resolve_scheduler_config(config, 131072, num_blocks=1 << 20, allow_long_max_model_len=True)
    assert allowed.max_model_len == 131073
    assert resolve_scheduler_config(EngineConfig(model="m"), 131072, num_blocks=1 << 20).max_model_len == 131072


def test_model_runner_refuses_a_max_model_len_beyond_the_model_before_loading(tmp_path: Path) -> None:
    from vllm_actors.runner.model_runner import ModelRunner

    _hf_config("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
               10000.0, 16, 4096).save_pretrained(tmp_path)  # no weights: it must fail before loading them
    with pytest.raises(ValueError, match=r"max_model_len \(4097\) is greater than the derived max_model_len \(4096"):
        ModelRunner(EngineConfig(model=str(tmp_path), max_model_len=4097, device="cpu", dtype="float32"))


# ------------------------------------------------------------------------------ long positions
def _reference_rotate(x: torch.Tensor, positions: list[int], inv_freq: list[float]) -> torch.Tensor:
    """x [T, H, D] rotated in float64, angles reduced exactly with Python integers and floats."""
    half = len(inv_freq)
    angles = torch.tensor([[p * f for f in inv_freq] for p in positions], dtype=torch.float64)
    cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("rope", [None, LLAMA31], ids=["default", "llama3"])
def test_rotary_is_accurate_near_one_million(rope: dict[str, Any] | None) -> None:
    theta, dim = 500000.0, 128
    scaling = normalize_rope_scaling(rope, 1 << 20)
    config = ModelConfig.from_hf_config(_hf_config("llama", rope or {"rope_type": "default"}, theta, dim,
                                                   1 << 20).to_dict())
    assert config.rope_scaling == scaling
    # the reference frequencies, from the formulas in Python floats
    inv_freq = [1.0 / theta ** (i / dim) for i in range(0, dim, 2)]
    if scaling is not None:
        old, low, high, factor = 8192.0, 1.0, 4.0, 8.0
        smooth = [min(max((old * f / (2 * math.pi) - low) / (high - low), 0.0), 1.0) for f in inv_freq]
        inv_freq = [(1 - s) * f / factor + s * f for s, f in zip(smooth, inv_freq, strict=True)]
    freqs = rope_frequencies(config)
    torch.testing.assert_close(freqs.inv_freq, torch.tensor(inv_freq, dtype=torch.float64), rtol=1e-14, atol=0)

    positions = list(range(999_000, 1_000_001, 7)) + [1_000_000]
    cos, sin = rope_cos_sin(torch.tensor(positions), freqs)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (len(positions), dim // 2)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn((len(positions), 2, dim), generator=generator)
    k = torch.randn((len(positions), 1, dim), generator=generator)
    got_q, got_k = qk_norm_rope_torch(q, k, cos, sin, None, None, 0.0)
    assert (got_q.double() - _reference_rotate(q, positions, inv_freq)).abs().max() < 2e-6
    assert (got_k.double() - _reference_rotate(k, positions, inv_freq)).abs().max() < 2e-6

    # the float32 angles this replaced are off by up to ~0.06 rad there
    angles32 = torch.tensor(positions).float().unsqueeze(1) * freqs.inv_freq.float().unsqueeze(0)
    old_q = qk_norm_rope_torch(q, k, angles32.cos(), angles32.sin(), None, None, 0.0)[0]
    assert (old_q.double() - _reference_rotate(q, positions, inv_freq)).abs().max() > 1e-2


def test_yarn_attention_factor_scales_cos_and_sin() -> None:
    freqs = RotaryFrequencies(torch.tensor([1.0, 0.01], dtype=torch.float64), attention_factor=1.25)
    cos, sin = rope_cos_sin(torch.tensor([0, 3]), freqs)
    torch.testing.assert_close(cos * cos + sin * sin, torch.full((2, 2), 1.25**2))
    assert float(cos[0, 0]) == 1.25 and float(sin[0, 0]) == 0.0
