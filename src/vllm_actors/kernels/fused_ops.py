"""Fused element-wise kernels for the decoder layer (Triton on a GPU, torch elsewhere).

The profile of a batch-1 decode step showed about 45 kernels per layer, most of them tiny
element-wise ops of RMSNorm and rotary embedding. These fuse each group into one pass:

- ``rms_norm(x, weight, eps, residual)``: optional residual add, then RMSNorm (one read, one or
  two writes); returns (normalised, new residual).
- ``qk_norm_rope(q, k, cos, sin, q_weight, k_weight, eps, kv_write)``: per-head RMSNorm of q and
  k (Qwen3) and rotary embedding (the "rotate half" layout), in place, in one launch for q and k;
  with ``kv_write`` it also stores k and v in the paged KV cache (one launch fewer per layer),
  quantised by ``kv_scales`` into an fp8 cache.
- ``silu_and_mul(gate_up)``: SiLU(gate) * up for the merged gate/up projection's output.

The torch versions are the reference and the CPU path; tests compare the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_actors.envs import envs
from vllm_actors.kernels import choice

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA tensors; VLLM_ACTORS_FUSED_OPS=torch forces the torch path, =triton the
    Triton one on any tensor (tests run it on the CPU under TRITON_INTERPRET=1)."""
    return choice.use_triton("VLLM_ACTORS_FUSED_OPS", HAVE_TRITON, x.device)


# (v [T, Hk, D], k_cache, v_cache [num_blocks, block_size, Hk, D], slot_mapping [T] int64)
KVWrite = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------------------------ references
def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


def qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D]; cos, sin [T, D/2] float32. Returns new tensors."""

    def one(x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if weight is not None:
            x = rms_norm_torch(x, weight, eps)[0]
        xf = x.float()
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return one(q, q_weight), one(k, k_weight)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------------------------ kernels
if HAVE_TRITON:
    from vllm_actors.kernels import pdl as pdl_module
    from vllm_actors.kernels import qk_rope_tiles
    from vllm_actors.kernels.pdl import pdl, pdl_enter
    from vllm_actors.kernels.triton_paged import _check_cache_pair, _to_cache, kv_scale_args

    @triton.jit
    def _rms_norm_kernel(
        x_ptr,
        residual_ptr,
        out_ptr,
        residual_out_ptr,
        weight_ptr,
        n_cols,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        PDL: tl.constexpr,
    ):
        pdl_enter(PDL)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        normed = _add_rms_norm_row(x_ptr, residual_ptr, residual_out_ptr, weight_ptr, row, cols, mask, n_cols,
                                   stride_x, stride_r, stride_ro, eps, HAS_RESIDUAL)
        tl.store(out_ptr + row * stride_o + cols, normed, mask=mask)

    @triton.jit
    def _add_rms_norm_row(x_ptr, residual_ptr, residual_out_ptr, weight_ptr, row, cols, mask, n_cols, stride_x,
                          stride_r, stride_ro, eps, HAS_RESIDUAL: tl.constexpr):
        """One row's RMSNorm(x + residual) * weight (the sum stored at ``residual_out_ptr``), normalised in
        float32 and rounded to x's dtype before the weight multiplies it (also `fp8_quant_fused.py`)."""
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(residual_out_ptr + row * stride_ro + cols, x.to(residual_out_ptr.dtype.element_ty), mask=mask)
            # the residual stream is kept in the activation dtype: normalise the rounded value
            x = tl.load(residual_out_ptr + row * stride_ro + cols, mask=mask, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, axis=0) / n_cols
        normed = x * tl.rsqrt(variance + eps)
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        return weight * normed.to(x_ptr.dtype.element_ty)

    @triton.jit
    def _norm_rope_head(base, cos_ptr, sin_ptr, weight_ptr, eps, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
        """One head's RMSNorm (HAS_NORM) and rotary, stored in place; returns the two halves."""
        half: tl.constexpr = HEAD_DIM // 2
        offsets = tl.arange(0, half)
        x1 = tl.load(base + offsets).to(tl.float32)
        x2 = tl.load(base + half + offsets).to(tl.float32)
        if HAS_NORM:
            variance = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM
            scale = tl.rsqrt(variance + eps)
            w1 = tl.load(weight_ptr + offsets)
            w2 = tl.load(weight_ptr + half + offsets)
            x1 = (w1 * (x1 * scale).to(w1.dtype)).to(tl.float32)
            x2 = (w2 * (x2 * scale).to(w2.dtype)).to(tl.float32)
        c = tl.load(cos_ptr + offsets)
        s = tl.load(sin_ptr + offsets)
        y1 = (x1 * c - x2 * s).to(base.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(base.dtype.element_ty)
        tl.store(base + offsets, y1)
        tl.store(base + half + offsets, y2)
        return y1, y2

    @triton.jit
    def _qk_norm_rope_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        q_weight_ptr,
        k_weight_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        k_scale_ptr,
        v_scale_ptr,
        num_q_heads,
        stride_qt,
        stride_qh,
        stride_kt,
        stride_kh,
        stride_vt,
        stride_vh,
        stride_cos,
        stride_cb,
        stride_cs,
        stride_ch,
        eps,
        HAS_NORM: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        WRITE_CACHE: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        PDL: tl.constexpr,
        EARLY: tl.constexpr,  # the slot (written before the step's first kernel) read before the PDL wait
        KV_FP8: tl.constexpr,
        FP8_MAX: tl.constexpr,
    ):
        """Program (token, head) over the q heads then the k heads; a k head's program also stores
        the rotated k and the token's v at its cache slot (WRITE_CACHE; a negative slot writes
        nothing; an fp8 cache quantised by the scales), which saves the KV-write kernel."""
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        slot = tl.zeros([], dtype=tl.int64)
        if WRITE_CACHE and EARLY:
            slot = tl.load(slot_ptr + token).to(tl.int64)
        pdl_enter(PDL)
        cos_row = cos_ptr + token * stride_cos
        sin_row = sin_ptr + token * stride_cos
        if head < num_q_heads:
            _norm_rope_head(
                q_ptr + token * stride_qt + head * stride_qh, cos_row, sin_row, q_weight_ptr, eps, HAS_NORM, HEAD_DIM
            )
        else:
            kv_head = head - num_q_heads
            y1, y2 = _norm_rope_head(
                k_ptr + token * stride_kt + kv_head * stride_kh, cos_row, sin_row, k_weight_ptr, eps, HAS_NORM, HEAD_DIM
            )
            if WRITE_CACHE:
                if not EARLY:
                    slot = tl.load(slot_ptr + token).to(tl.int64)
                if slot >= 0:
                    half: tl.constexpr = HEAD_DIM // 2
                    offsets = tl.arange(0, half)
                    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
                    tl.store(k_cache_ptr + dst + offsets, _to_cache(y1, k_cache_ptr, k_scale_ptr, KV_FP8, FP8_MAX))
                    tl.store(
                        k_cache_ptr + dst + half + offsets, _to_cache(y2, k_cache_ptr, k_scale_ptr, KV_FP8, FP8_MAX)
                    )
                    dims = tl.arange(0, HEAD_DIM)
                    v = tl.load(v_ptr + token * stride_vt + kv_head * stride_vh + dims)
                    tl.store(v_cache_ptr + dst + dims, _to_cache(v, v_cache_ptr, v_scale_ptr, KV_FP8, FP8_MAX))

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, n_cols, stride_x, stride_o, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        tl.store(out_ptr + row * stride_o + cols, _silu_mul_row(x_ptr, row, cols, mask, n_cols, stride_x), mask=mask)

    @triton.jit
    def _silu_mul_row(x_ptr, row, cols, mask, n_cols, stride_x):
        """SiLU(gate) * up over ``cols`` of one row of [gate | up], in x's dtype: SiLU in float32, rounded
        to the dtype before the product (also `fp8_quant_fused.py`)."""
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
        silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
        return silu * up


# ------------------------------------------------------------------------------------ entry points
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); without a residual the second is x."""
    if not use_triton(x) or x.shape[0] == 0:
        return rms_norm_torch(x, weight, eps, residual)
    rows, cols = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else x
    _rms_norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        out,
        residual_out,
        weight,
        cols,
        x.stride(0),
        (residual if residual is not None else x).stride(0),
        out.stride(0),
        residual_out.stride(0),
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(cols),
        **pdl(x),
        num_warps=4,
    )
    return out, residual_out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    kv_write: KVWrite | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm (when weights are given) then rotary, on q [T, Hq, D] and k [T, Hk, D]
    (views into the fused QKV output: their last dimension must be contiguous), in one launch.

    With ``kv_write`` (Triton path only: check ``fuses_kv_write`` first) the same launch stores
    the rotated k and the given v at each token's cache slot, as `write_kv_cache_triton` does
    (into an fp8 cache quantised by ``kv_scales``: the layer's k_scale and v_scale)."""
    if not use_triton(q) or q.shape[0] == 0:
        if kv_write is not None:
            raise ValueError("qk_norm_rope writes the KV cache only on its Triton path (see fuses_kv_write)")
        return qk_norm_rope_torch(q, k, cos, sin, q_weight, k_weight, eps)
    tokens, num_q_heads, head_dim = q.shape
    if kv_write is not None:
        v, k_cache, v_cache, slots = kv_write
        _check_cache_pair(k_cache, v_cache)
        if k_cache.shape[2:] != k.shape[1:]:
            raise ValueError("the caches must be [num_blocks, block_size, num_kv_heads, head_dim] like k")
        if v.shape != k.shape or v.stride(-1) != 1:
            raise ValueError("v must match k's shape with a unit last stride")
        cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
        block_size = k_cache.shape[1]
        scales = kv_scale_args(k_cache, *(kv_scales or (None, None)))
    else:
        v, k_cache, v_cache, slots = k, k, k, cos  # never read
        cache_strides, block_size = (0, 0, 0), 1
        scales = kv_scale_args(k, None, None)
    arguments = (
        q, k, v, cos, sin,
        q_weight if q_weight is not None else cos, k_weight if k_weight is not None else cos,
        k_cache, v_cache, slots, scales.k_scale, scales.v_scale,
        num_q_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        *cache_strides, eps,
    )  # fmt: skip
    options = dict(HAS_NORM=q_weight is not None, HEAD_DIM=head_dim, WRITE_CACHE=kv_write is not None,
                   BLOCK_SIZE=block_size, **pdl(q), EARLY=pdl_module.early_loads(), KV_FP8=scales.fp8,
                   FP8_MAX=scales.fp8_max, num_warps=1)
    if tokens >= qk_rope_tiles.TILED_FROM_TOKENS:  # prefill chunks: a program per tile of tokens
        qk_rope_tiles.launch_tiles(q, k, arguments, options)
    else:
        _qk_norm_rope_kernel[(tokens, num_q_heads + k.shape[1])](*arguments, **options)
    return q, k


def fuses_kv_write(q: torch.Tensor) -> bool:
    """Whether ``qk_norm_rope`` can store k and v in the KV cache for tensors like q (its Triton
    path); VLLM_ACTORS_FUSED_KV_WRITE=0 keeps the write in the attention backend."""
    return use_triton(q) and envs.VLLM_ACTORS_FUSED_KV_WRITE


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if not use_triton(gate_up) or gate_up.shape[0] == 0:
        return silu_and_mul_torch(gate_up)
    rows, double = gate_up.shape
    cols = double // 2
    out = torch.empty((rows, cols), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(cols, block))](
        gate_up, out, cols, gate_up.stride(0), out.stride(0), BLOCK=block, **pdl(out),
        num_warps=4,
    )
    return out
