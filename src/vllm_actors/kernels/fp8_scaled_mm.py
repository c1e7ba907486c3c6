"""Block-scaled FP8 GEMMs through ``torch._scaled_mm`` (cuBLASLt on Hopper): ``x_q [M, K] @ w_q[N, K].T``
with a float32 scale per token and 128 inputs (1x128) and per [128, 128] weight block (128x128), the
recipe of Qwen3-FP8 and DeepSeek-V3, accumulated in float32 by the library's kernel.

Whether the installed torch and GPU run it, and with which scale layouts, is found once per device
by a probe (``layout``): a small product with M not a multiple of 16, against the float64 reference
(``fp8_linear_reference``). torch's ``aten/src/ATen/native/cuda/ScaledBlas.cpp`` takes the recipe on
SM90 only, with cuBLASLt 12.9 or later, ``x_q`` row-major and the weight column-major (``w_q.t()``), K
and N multiples of 16, and checks the float32 scales' shapes and strides exactly:

- the activations' 1x128 scales ``[M, K/128]`` "outer-dim-major": strides ``(1, M)``;
- ``torch._scaled_mm`` takes the weight's 128x128 scales as ``scale_b`` with ``scale_b.t()`` of shape
  ``[N/128, K/128]`` and strides ``(K/128, 1)``: the checkpoint's ``[N/128, K/128]`` scales transposed
  (a view, no padding);
- ``torch.nn.functional.scaled_mm`` (the explicit BlockWise1x128 / BlockWise128x128 recipes) takes
  them as ``[round_up(K/128, 4), N/128]`` with strides ``(1, round_up(K/128, 4))``: the same view
  where K/128 is a multiple of 4 (cuBLASLt's 16-byte leading dimension), else zero-padded K blocks.

``takes`` asks for K a multiple of 512 (K/128 a multiple of 4, as the probe's product has: every
Qwen3 projection), so that both calls see the same scales. The probe tries those two layouts with M
padded to a multiple of 4 (zero rows, cut from the output: the activation scales' leading dimension in
16 bytes, which torch 2.11's cuBLASLt wanted on the H200), then both unpadded.
Where none gives the reference's result, or the call raises, ``fp8_linear`` keeps the Triton GEMM
(``kernels/fp8_gemm.py``). The probe never runs while a CUDA graph is captured (it synchronises):
then the Triton GEMM runs, and the probe runs at the next eager call. ``VLLM_ACTORS_FP8_SCALED_MM=0``
turns the path off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from vllm_actors.envs import envs
from vllm_actors.kernels.fp8_quant_torch import fp8_linear_reference, quantize_weight

log = structlog.get_logger(__name__)

BLOCK = (128, 128)  # the one block this path takes (cuBLASLt's 1x128 / 128x128 recipe)
PROBE_SHAPE = (37, 512, 384)  # M (not a multiple of 4), K (4 scale blocks), N of the probe's product
K_ALIGN = 512  # K: scale blocks a multiple of 4 (module docstring)
PROBE_TOLERANCE = 1e-2  # relative Frobenius error against float64 (bfloat16 output: ~3e-3)


@dataclass(frozen=True)
class ScaleLayout:
    """How the scales are laid out for ``torch._scaled_mm``: the activations' ``[M, K/128]`` column-major
    (else row-major), the weights' ``[K/128, N/128]`` column-major (else row-major) and its K blocks
    padded to a multiple of 4; ``pad_m``: M padded to a multiple of 4 (zero rows, cut from the output);
    ``functional``: through ``torch.nn.functional.scaled_mm`` with the recipes named."""

    a_column_major: bool
    b_column_major: bool
    b_pad_k: bool
    pad_m: bool = False
    functional: bool = False


# M padded first (torch 2.11 with CUDA 13 on the H200 ran the padded ones and answered the unpadded ones with
# CUBLAS_STATUS_NOT_SUPPORTED: benchmarks/fp8_probe.py), each as torch._scaled_mm's layout then the explicit
# recipes'; torch refuses row-major activation scales and row-major weight scales for this recipe
LAYOUTS = (ScaleLayout(True, True, False, pad_m=True), ScaleLayout(True, True, True, pad_m=True, functional=True),
           ScaleLayout(True, True, False), ScaleLayout(True, True, True, functional=True))
M_ALIGN = 4  # rows: the activation scales' leading dimension in 16 bytes
_probed: dict[int, ScaleLayout | None] = {}  # device index: the layout that gave the reference's result, or None


def weight_scales(weight_scale: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """The weight's ``[N/128, K/128]`` block scales as ``[K/128 (padded), N/128]`` in ``layout`` (a view
    of ``weight_scale`` where no padding or copy is needed: Qwen3-8B's K blocks are multiples of 4)."""
    blocks_n, blocks_k = weight_scale.shape
    padded_k = -(-blocks_k // 4) * 4 if layout.b_pad_k else blocks_k
    if layout.b_column_major:
        if padded_k == blocks_k and weight_scale.is_contiguous():
            return weight_scale.t()
        padded = torch.zeros((blocks_n, padded_k), dtype=torch.float32, device=weight_scale.device)
        padded[:, :blocks_k] = weight_scale
        return padded.t()
    rows = torch.zeros((padded_k, blocks_n), dtype=torch.float32, device=weight_scale.device)
    rows[:blocks_k] = weight_scale.t()
    return rows


def padded_rows(rows: int, layout: ScaleLayout) -> int:
    """The rows the activations are quantized into for ``layout`` (``pad_m``: a multiple of ``M_ALIGN``)."""
    return -(-rows // M_ALIGN) * M_ALIGN if layout.pad_m else rows


def scaled_mm(x_q: torch.Tensor, x_s: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              layout: ScaleLayout, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequantize(x_q, x_s) @ dequantize(weight, weight_scale).T + bias`` by ``torch._scaled_mm`` (or
    ``torch.nn.functional.scaled_mm``); ``x_q``, ``x_s`` [M, K/128] already in ``layout``
    (``quantize_activations(..., column_major=...)`` of ``padded_rows`` rows)."""
    scale_b = weight_scales(weight_scale, layout)
    if layout.functional:
        functional = torch.nn.functional
        out = functional.scaled_mm(x_q, weight.t(), x_s, functional.ScalingType.BlockWise1x128, scale_b,
                                   functional.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    else:
        out = torch._scaled_mm(x_q, weight.t(), scale_a=x_s, scale_b=scale_b, out_dtype=out_dtype)
    return out if bias is None else out + bias


def pad_rows(x: torch.Tensor, layout: ScaleLayout) -> torch.Tensor:
    """``x`` with zero rows up to ``padded_rows`` (itself where none are needed)."""
    rows = padded_rows(x.shape[0], layout)
    return x if rows == x.shape[0] else torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))


def takes(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None) -> bool:
    """Whether the shapes suit the library's kernel: [128, 128] blocks, K a multiple of 512 (``K_ALIGN``)
    and N of 128, on CUDA."""
    return (x.is_cuda and block is not None and tuple(block) == BLOCK and weight.shape[1] % K_ALIGN == 0
            and weight.shape[0] % 128 == 0 and envs.VLLM_ACTORS_FP8_SCALED_MM)


def layout(device: torch.device, quantize: Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]],
           ) -> ScaleLayout | None:
    """The scale layout with which ``torch._scaled_mm`` gives the float64 reference's result on
    ``device`` (probed once; ``quantize(x, column_major)``: the activations' quantization), or None:
    the Triton GEMM. None, unprobed, while the current stream captures a CUDA graph."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _probed:
        return _probed[index]
    if torch.cuda.is_current_stream_capturing():
        return None
    _probed[index] = _probe(torch.device("cuda", index), quantize)
    return _probed[index]


def _probe(device: torch.device,
           quantize: Callable[[torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]) -> ScaleLayout | None:
    if not hasattr(torch, "_scaled_mm"):
        return None
    rows, k, n = PROBE_SHAPE
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((rows, k), generator=gen, device=device).to(torch.bfloat16)
    weight, scale = quantize_weight(0.02 * torch.randn((n, k), generator=gen, device=device), BLOCK)
    errors = []
    for candidate in LAYOUTS:
        if candidate.functional and not hasattr(torch.nn.functional, "scaled_mm"):
            continue
        try:
            x_q, x_s = quantize(pad_rows(x, candidate), candidate.a_column_major)
            got = scaled_mm(x_q, x_s, weight, scale, candidate, None, torch.bfloat16)[:rows].double()
            want = fp8_linear_reference(x_q[:rows], x_s[:rows].contiguous(), weight, scale, BLOCK)
            error = float((got - want).norm() / want.norm())
        except (RuntimeError, ValueError, TypeError) as caught:  # this torch refuses the layout or the recipe
            errors.append(f"{candidate}: {str(caught).splitlines()[0][:160]}")
            continue
        if error < PROBE_TOLERANCE:
            log.info("fp8_scaled_mm", layout=str(candidate), relative_error=round(error, 5))
            return candidate
        errors.append(f"{candidate}: relative error {error:.3g}")
    log.info("fp8_scaled_mm_unavailable", why=errors)
    return None
