"""FP8 weights and activations in torch: the scales' layout (``weight_groups``), quantization and
dequantization, and ``fp8_linear_reference``, the float64 product the FP8 GEMMs of
``kernels/fp8_gemm.py`` compute up to rounding (tests). The CPU path dequantizes at load with these;
tests quantize with them. ``fp8_gemm`` re-exports every name here.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest e4m3 value
AMAX_FLOOR = 1e-10  # an all-zero group gets a tiny scale, not a division by zero (vLLM's eps)


def _expand(scale: torch.Tensor, shape: torch.Size, group_n: int, group_k: int) -> torch.Tensor:
    """Per-element scales of a ``shape`` weight from its per-block ``scale``."""
    rows, cols = shape
    return scale.repeat_interleave(group_n, 0)[:rows].repeat_interleave(group_k, 1)[:, :cols]


def weight_groups(shape: torch.Size | list[int], block: tuple[int, int] | None) -> tuple[int, int]:
    """``(group_n, group_k)`` of a weight's scales: the block, or one scale per row (channel)."""
    return block if block is not None else (1, int(shape[1]))


def quantize_weight(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scale) with ``scale`` per block ``[ceil(N/bn), ceil(K/bk)]``, or per
    row ``[N, 1]`` when ``block`` is None: ``weight / scale`` saturated to e4m3, ``scale = amax / 448``."""
    w = weight.float()
    group_n, group_k = weight_groups(w.shape, block)
    rows, cols = w.shape
    pad = torch.zeros(-(-rows // group_n) * group_n, -(-cols // group_k) * group_k, dtype=torch.float32,
                      device=w.device)
    pad[:rows, :cols] = w
    blocks = pad.view(pad.shape[0] // group_n, group_n, pad.shape[1] // group_k, group_k)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / FP8_MAX
    quantized = (w / _expand(scale, w.shape, group_n, group_k)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """float32 ``weight * scale``, ``scale`` per block (``block``), per row ``[N, 1]`` or one element."""
    w = weight.float()
    if scale.numel() == 1:
        return w * scale.float().reshape(())
    group_n, group_k = weight_groups(w.shape, block)
    return w * _expand(scale.float().reshape(-1, scale.shape[-1]), w.shape, group_n, group_k)


def quantize_activations_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 x, float32 scales [M, ceil(K/group)]): what ``quantize_activations`` computes."""
    quantized, scale = quantize_weight(x, (1, group))
    return quantized, scale


def fp8_linear_reference(
    x_q: torch.Tensor, x_s: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
    block: tuple[int, int] | None, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """float64 ``dequantize(x_q) @ dequantize(weight).T + bias`` (the kernels' result up to rounding)."""
    group_k = weight_groups(weight.shape, block)[1]
    x = x_q.double() * _expand(x_s.double(), x_q.shape, 1, group_k)
    w = dequantize_weight(weight, weight_scale, block).double()
    out = x @ w.T
    return out if bias is None else out + bias.double()
