"""FP8 activation quantization fused into its producer: RMSNorm (with or without the residual add)
and SiLU(gate) * up write the next FP8 projection's input as ``fp8_gemm.quantize_activations`` would
(e4m3 values and a float32 scale per token and group, ``amax / 448``), without storing the bf16
activations and running the quantization kernel on them (vLLM's RMSNorm + per-token-group quant and
SiLU-mul + quant fusions).

Each program computes the producer's value exactly as ``fused_ops``' kernels store it (rounded to the
activations' dtype), then quantizes it with the quantization kernel's arithmetic (``_round_e4m3``), so
``x_q`` and ``x_s`` are bit-identical to the unfused path's. They are written in the layout the GEMM
takes (``fp8_gemm.GemmPlan``): for cuBLASLt rows padded (zero rows, as ``fp8_scaled_mm.pad_rows``
gives) and the scales column-major where the layout says so; for the Triton kernels row-major.
"""

from __future__ import annotations

import torch

from vllm_actors.kernels import fp8_scaled_mm
from vllm_actors.kernels.fp8_gemm import FP8_DTYPE, HAVE_TRITON, QuantizedActivations
from vllm_actors.kernels.fp8_scaled_mm import ScaleLayout

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from vllm_actors.kernels.fp8_gemm import _round_e4m3
    from vllm_actors.kernels.fused_ops import _add_rms_norm_row, _silu_mul_row
    from vllm_actors.kernels.pdl import pdl, pdl_enter

    @triton.jit
    def _store_quantized(y, q_ptr, s_ptr, stride_sg, first_col, n_cols, BLOCK: tl.constexpr, GROUP: tl.constexpr):
        """``y`` [BLOCK] (float32, columns ``first_col`` on, zeros past ``n_cols``) quantized per ``GROUP``
        columns into the row at ``q_ptr`` and its scales at ``s_ptr``, as ``_quant_kernel`` does."""
        groups: tl.constexpr = BLOCK // GROUP
        tiles = tl.reshape(y, (groups, GROUP))
        scale = tl.maximum(tl.max(tl.abs(tiles), axis=1), 1e-10) / 448.0
        q = _round_e4m3(tl.minimum(tl.maximum(tiles / scale[:, None], -448.0), 448.0))
        cols = first_col + tl.arange(0, groups)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        tl.store(q_ptr + cols, q.to(q_ptr.dtype.element_ty), mask=cols < n_cols)
        group = first_col // GROUP + tl.arange(0, groups)
        tl.store(s_ptr + group * stride_sg, scale, mask=group * GROUP < n_cols)

    @triton.jit
    def _rms_norm_quant_kernel(
        x_ptr, residual_ptr, residual_out_ptr, weight_ptr, q_ptr, s_ptr, M, n_cols,
        stride_x, stride_r, stride_ro, stride_q, stride_s, stride_sg, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
    ):
        """One row of ``fused_ops._rms_norm_kernel``, quantized."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = (cols < n_cols) & (row + tl.zeros_like(cols) < M)  # a padding row past M: zeros
        normed = _add_rms_norm_row(x_ptr, residual_ptr, residual_out_ptr, weight_ptr, row, cols, mask, n_cols,
                                   stride_x, stride_r, stride_ro, eps, HAS_RESIDUAL)
        y = normed.to(x_ptr.dtype.element_ty).to(tl.float32)  # the value the norm would store
        _store_quantized(y, q_ptr + row * stride_q, s_ptr + row * stride_s, stride_sg, 0, n_cols, BLOCK, GROUP)

    @triton.jit
    def _silu_mul_quant_kernel(
        x_ptr, q_ptr, s_ptr, M, n_cols, stride_x, stride_q, stride_s, stride_sg,
        BLOCK: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr,
    ):
        """``BLOCK`` columns of one row of ``fused_ops._silu_and_mul_kernel``, quantized."""
        pdl_enter(PDL)
        row = tl.program_id(0)
        first = tl.program_id(1) * BLOCK
        cols = first + tl.arange(0, BLOCK)
        mask = (cols < n_cols) & (row + tl.zeros_like(cols) < M)  # a padding row past M: zeros
        y = _silu_mul_row(x_ptr, row, cols, mask, n_cols, stride_x).to(tl.float32)  # what silu_and_mul stores
        _store_quantized(y, q_ptr + row * stride_q, s_ptr + row * stride_s, stride_sg, first, n_cols, BLOCK, GROUP)


SILU_COLUMNS = 1024  # columns of one SiLU-mul program (whole groups of 128)


def takes(group: int, k: int) -> bool:
    """Whether the fused kernels cover groups of ``group`` over ``k`` columns: one group per row
    (``group >= k``), or a power-of-two group of at least 16 (the Triton GEMM's and cuBLASLt's)."""
    return HAVE_TRITON and k > 0 and (group >= k or (group >= 16 and not group & (group - 1)))


def _check(x: torch.Tensor, k: int, group: int) -> None:
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"the fused FP8 quantization takes a 2-D input with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if not takes(group, k):
        raise ValueError(f"the fused FP8 quantization takes groups of a power of two >= 16 or a whole row, got {group} "
                         f"over {k} columns")


def _outputs(x: torch.Tensor, rows: int, k: int, group: int,
             layout: ScaleLayout | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Empty x_q [padded, k] and x_s [padded, groups] as ``fp8_linear`` quantizes for ``layout``."""
    padded = fp8_scaled_mm.padded_rows(rows, layout) if layout is not None else rows
    groups = -(-k // group)
    q = torch.empty((padded, k), dtype=FP8_DTYPE, device=x.device)
    s = (torch.empty((groups, padded), dtype=torch.float32, device=x.device).t()
         if layout is not None and layout.a_column_major
         else torch.empty((padded, groups), dtype=torch.float32, device=x.device))
    return q, s, padded


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, group: int,
    layout: ScaleLayout | None,
) -> tuple[QuantizedActivations, torch.Tensor]:
    """(the quantized ``fused_ops.rms_norm(x, weight, eps, residual)[0]``, x + residual): equal to
    ``quantize_activations`` of the norm's output for ``layout`` (None: the Triton GEMM's)."""
    rows, k = x.shape
    _check(x, k, group)
    q, s, padded = _outputs(x, rows, k, group, layout)
    residual_out = torch.empty_like(x) if residual is not None else x
    block = triton.next_power_of_2(k)
    _rms_norm_quant_kernel[(padded,)](
        x, residual if residual is not None else x, residual_out, weight, q, s, rows, k,
        x.stride(0), (residual if residual is not None else x).stride(0), residual_out.stride(0),
        q.stride(0), s.stride(0), s.stride(1), eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, GROUP=block if group >= k else group, **pdl(x), num_warps=4,
    )  # fmt: skip
    return QuantizedActivations(q, s, rows, x.dtype, layout), residual_out


def silu_mul_quant(gate_up: torch.Tensor, group: int, layout: ScaleLayout | None) -> QuantizedActivations:
    """The quantized ``fused_ops.silu_and_mul(gate_up)`` (gate_up [M, 2K]), as ``rms_norm_quant``."""
    rows, double = gate_up.shape
    k = double // 2
    _check(gate_up, k, group)
    q, s, padded = _outputs(gate_up, rows, k, group, layout)
    block = triton.next_power_of_2(k) if group >= k else max(group, SILU_COLUMNS)
    _silu_mul_quant_kernel[(padded, triton.cdiv(k, block))](
        gate_up, q, s, rows, k, gate_up.stride(0), q.stride(0), s.stride(0), s.stride(1),
        BLOCK=block, GROUP=block if group >= k else group, **pdl(gate_up), num_warps=4,
    )
    return QuantizedActivations(q, s, rows, gate_up.dtype, layout)
