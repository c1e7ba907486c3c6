"""Fused elementwise Triton kernels for the decoder layer: RMSNorm (optionally with the residual add
before it), SiLU(gate) * up, and rotary embedding of q and k in one pass.

Each follows the rounding of the torch code in `vllm_actors.models.llama` (math in float32, results
rounded to the input dtype where torch rounds them), so swapping one in changes outputs by at most
a rounding step of the dtype. Inputs are [..., n] tensors with a unit last stride.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_ELEMENTS_PER_PROGRAM = 4096


# ----------------------------------------------------------------------------------------------
# RMSNorm (+ residual)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_rows,
    num_cols,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < num_rows) & (cols[None, :] < num_cols)
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # torch adds in the dtype
        tl.store(residual_out_ptr + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, 1) / num_cols + eps)
    normed = (xf * inv_rms[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=cols < num_cols, other=0.0).to(tl.float32)
    out = (normed * w[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rmsnorm(x) over the last dim, as `llama.RMSNorm` computes it.

    With residual: s = x + residual; returns (weight * rmsnorm(s), s) — the decoder's
    "add the sublayer output, then normalize for the next sublayer" in one pass.
    """
    num_cols = x.shape[-1]
    x2 = x.reshape(-1, num_cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    num_rows = x2.shape[0]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty((num_rows, num_cols), dtype=out_dtype, device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, num_cols)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        residual_out = torch.empty_like(x2)
    else:
        r2 = residual_out = x2  # never read
    if num_rows:
        block_c = triton.next_power_of_2(num_cols)
        block_r = max(1, min(_ELEMENTS_PER_PROGRAM // block_c, triton.next_power_of_2(num_rows)))
        _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
            x2,
            r2,
            weight,
            out,
            residual_out,
            num_rows,
            num_cols,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            residual_out.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK_R=block_r,
            BLOCK_C=block_c,
            num_warps=4 if block_c * block_r >= 2048 else 2,
        )
    out = out.view(x.shape)
    if residual is None:
        return out
    return out, residual_out.view(x.shape)


# ----------------------------------------------------------------------------------------------
# SiLU(gate) * up
# ----------------------------------------------------------------------------------------------


@triton.jit
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    num_rows,
    num_cols,
    stride_g,
    stride_u,
    stride_o,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = cols < num_cols
    g = tl.load(gate_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)  # torch rounds F.silu's result
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor | None = None) -> torch.Tensor:
    """F.silu(gate) * up. With up None, gate is [..., 2 * n] holding gate then up (a merged projection)."""
    if up is None:
        half = gate.shape[-1] // 2
        gate, up = gate[..., :half], gate[..., half:]
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    num_cols = gate.shape[-1]
    g2, u2 = gate.reshape(-1, num_cols), up.reshape(-1, num_cols)
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if u2.stride(-1) != 1:
        u2 = u2.contiguous()
    num_rows = g2.shape[0]
    out = torch.empty((num_rows, num_cols), dtype=gate.dtype, device=gate.device)
    if num_rows and num_cols:
        block_c = min(1024, triton.next_power_of_2(num_cols))
        _silu_mul_kernel[(num_rows, triton.cdiv(num_cols, block_c))](
            g2, u2, out, num_rows, num_cols, g2.stride(0), u2.stride(0), out.stride(0), BLOCK_C=block_c, num_warps=4
        )
    return out.view(gate.shape)


# ----------------------------------------------------------------------------------------------
# Rotary embedding of q and k ("rotate half" layout: pairs (i, i + D/2))
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(
    x_ptr,
    out_ptr,
    positions_ptr,
    inv_freq_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF)
    mask = heads[:, None] < num_heads
    angle = tl.load(positions_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + dims)
    # the model rounds cos and sin to the activation dtype before using them
    cos = tl.cos(angle).to(x_ptr.dtype.element_ty).to(tl.float32)
    sin = tl.sin(angle).to(x_ptr.dtype.element_ty).to(tl.float32)
    base = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(dst, out1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, out2.to(out_ptr.dtype.element_ty), mask=mask)


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, out: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        x,
        out,
        positions,
        inv_freq,
        num_heads,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        HEADS_PAD=triton.next_power_of_2(num_heads),
        HALF=head_dim // 2,
        num_warps=4 if num_heads * head_dim >= 2048 else 2,
    )


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inplace: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, H, D] and k [T, Hkv, D] by angles positions[t] * inv_freq (float32, [D/2]),
    as `llama.apply_rotary` with cos/sin built by `CausalLM.forward`. inplace writes into q and k."""
    head_dim = q.shape[-1]
    if head_dim % 2 or (head_dim // 2) & (head_dim // 2 - 1):
        raise ValueError(f"rotary needs head_dim = 2 * a power of two, got {head_dim}")
    if inv_freq.shape[-1] != head_dim // 2:
        raise ValueError(f"inv_freq has {inv_freq.shape[-1]} entries, expected {head_dim // 2}")
    inv_freq = inv_freq.float().contiguous()
    results = []
    for x in (q, k):
        if inplace and x.stride(-1) != 1:
            raise ValueError("inplace rotary needs a unit last stride")
        out = x if inplace else torch.empty_like(x, memory_format=torch.contiguous_format)
        _rotate(x, positions, inv_freq, out)
        results.append(out)
    return results[0], results[1]
