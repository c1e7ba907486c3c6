"""Rotary position embedding: inverse frequencies per rope type, cos/sin of a step's positions, and
the rotation by them (``apply_rotary``, in the HF "rotate half" layout).

The frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` (``modeling_rope_utils.py``) for
``linear``, ``yarn`` and ``llama3``; ``dynamic`` (NTK) takes vLLM's fixed base, the one
transformers computes for a sequence of max_position_embeddings * factor tokens (transformers
recomputes it per forward from the current length; positions here are computed once per step, for
sequences of any length in one batch, so the base must not depend on the batch).

Precision: an angle is position * inv_freq. In float32 both factors carry a relative error of
about 6e-8, which at position 1,000,000 is ~0.06 rad. Here inv_freq is kept in float64 and the
angles, cos and sin are computed in float64 from the step's positions (no table: [T, head_dim/2]
values per step), then stored as float32, the dtype the rotary kernels read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_actors.models.config import ModelConfig


@dataclass(frozen=True)
class RotaryFrequencies:
    """``inv_freq`` [head_dim // 2] float64 and the factor cos and sin are multiplied by (yarn's mscale)."""

    inv_freq: torch.Tensor
    attention_factor: float = 1.0

    def to(self, device: torch.device) -> RotaryFrequencies:
        return RotaryFrequencies(self.inv_freq.to(device), self.attention_factor)


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    return 1.0 / (base**exponents)


def rope_frequencies(config: ModelConfig) -> RotaryFrequencies:
    """The rotary frequencies of ``config`` (on the CPU, float64)."""
    dim, base = config.head_dim, config.rope_theta
    scaling = config.rope_scaling
    if scaling is None:
        return RotaryFrequencies(_base_inv_freq(base, dim))
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return RotaryFrequencies(_base_inv_freq(base, dim) / scaling["factor"])
    if rope_type == "dynamic":
        factor = scaling["factor"]
        # transformers' formula at seq_len = max_position_embeddings * factor (vLLM's fixed base)
        ntk_base = base * (factor * factor - (factor - 1)) ** (dim / (dim - 2))
        return RotaryFrequencies(_base_inv_freq(ntk_base, dim))
    if rope_type == "llama3":
        return RotaryFrequencies(_llama3_inv_freq(_base_inv_freq(base, dim), scaling))
    if rope_type == "yarn":
        return RotaryFrequencies(_yarn_inv_freq(base, dim, scaling), float(scaling["attention_factor"]))
    raise ValueError(f"unsupported rope scaling {scaling}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, float]) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between blended
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq


def _yarn_inv_freq(base: float, dim: int, scaling: dict[str, float]) -> torch.Tensor:
    """Interpolated (divided by factor) below the correction range of dimensions, extrapolated
    (kept) above it, a linear ramp between; the range is where a frequency turns beta_fast to
    beta_slow times over original_max_position_embeddings."""
    original = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    extrapolation = _base_inv_freq(base, dim)
    return extrapolation / scaling["factor"] * ramp + extrapolation * (1.0 - ramp)


def rope_cos_sin(positions: torch.Tensor, freqs: RotaryFrequencies) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, head_dim // 2] float32 of ``positions`` [T] (integers), on their device;
    computed in float64 so that positions near 1,000,000 keep float32 accuracy."""
    angles = positions.to(torch.float64).unsqueeze(1) * freqs.inv_freq.unsqueeze(0)
    cos, sin = angles.cos(), angles.sin()
    if freqs.attention_factor != 1.0:
        cos, sin = cos * freqs.attention_factor, sin * freqs.attention_factor
    return cos.float(), sin.float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by (cos, sin) [T, D]; pairs are (i, i + D/2) (the HF "rotate half" layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)
