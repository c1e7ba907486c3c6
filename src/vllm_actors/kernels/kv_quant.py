"""The KV cache's storage dtype (vLLM's ``kv_cache_dtype``) and the torch reference of its fp8
quantisation.

An fp8 cache stores ``saturate(x / scale)`` cast to the format, one float32 scale per layer for k and
one for v (``k_scale``, ``v_scale``: float32 tensors of one element on the cache's device, so a
captured CUDA graph reads their current value); a reader multiplies by the scale again. The Triton
kernels do the same arithmetic (division rounded to nearest, saturation, a round-to-nearest cast),
so the torch path and the kernels store the same bytes.
"""

from __future__ import annotations

import torch

# "fp8" is e4m3 as in vLLM on NVIDIA GPUs; e5m2 keeps its scales at 1.0 (vLLM reads none for it).
_FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# vLLM's calculate_kv_scales divides each layer's first amax by these (its K_SCALE_CONSTANT and
# V_SCALE_CONSTANT defaults): the largest |k| maps to 200 of e4m3's 448, the largest |v| to 100.
K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for ``kv_cache_dtype`` ``name`` ("auto": the model's)."""
    if name == "auto":
        return model_dtype
    if name not in _FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {('auto', *_FP8_DTYPES)}, got {name!r}")
    return _FP8_DTYPES[name]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_KV_DTYPES


def has_scales(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` takes the checkpoint's or calculated scales (e4m3 only)."""
    return dtype == torch.float8_e4m3fn


def fp8_max(dtype: torch.dtype) -> float:
    """The format's largest finite value: stores saturate to it (448 for e4m3, 57344 for e5m2)."""
    return float(torch.finfo(dtype).max)


def checked_scale(scale: torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor:
    """The scale an fp8 cache needs: a float32 tensor of one element on the cache's device."""
    if scale is None:
        raise ValueError(f"a {cache.dtype} KV cache needs its layer's k_scale and v_scale")
    if scale.dtype != torch.float32 or scale.numel() != 1 or scale.device != cache.device:
        raise ValueError(
            f"k_scale/v_scale must be float32 tensors of one element on {cache.device}, "
            f"got {scale.dtype} {tuple(scale.shape)} on {scale.device}"
        )
    return scale


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in float32, saturated to the format's range, cast to the fp8 ``dtype``."""
    bound = fp8_max(dtype)
    return (x.float() / scale.float()).clamp(-bound, bound).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor back in float32: ``x * scale``."""
    return x.float() * scale.float()


def calculate_kv_scales(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Set the scales in place from this batch's amax, as vLLM's calculate_kv_scales does (no host
    sync). An all-zero batch would give 0: it keeps 1.0 instead."""
    for x, scale, constant in ((k, k_scale, K_SCALE_CONSTANT), (v, v_scale, V_SCALE_CONSTANT)):
        amax = x.detach().abs().amax().float() / constant
        scale.copy_(torch.where(amax > 0, amax, torch.ones_like(amax)).reshape(scale.shape))


def kv_scale_tensors(
    device: torch.device, k_scale: float = 1.0, v_scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (k_scale, v_scale): float32 tensors of one element on ``device``."""
    return (
        torch.tensor([k_scale], dtype=torch.float32, device=device),
        torch.tensor([v_scale], dtype=torch.float32, device=device),
    )
