"""What the paged-attention Triton kernels share (`triton_varlen`, `triton_decode`): the KV write,
the online-softmax step over one tile of keys read through a block table, the tile config, and the
host-side shape checks. The layout and contracts are in `triton_attention`'s docstring.

An fp8 cache (``KV_FP8``) is written as ``saturate(x / scale)`` cast to the format, as
`kv_quant.quantize` does; readers convert each tile to the query's dtype and fold the scales in
outside the inner loop: k_scale into the softmax scale, v_scale into the output."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_actors.envs import envs
from vllm_actors.kernels import kv_quant

# Triton picks interpreter or compiler when a kernel is decorated, i.e. when this module is imported.
# The interpreter's tl.dot mishandles bfloat16 (it multiplies the raw uint16 bits), so under it
# the operands are widened to float32 first; products of bf16/fp16 values are exact in float32,
# so the result matches the GPU's fp32-accumulating tensor-core dot. Read at import, as triton does.
INTERPRET: bool = envs.TRITON_INTERPRET

_LOG2E = 1.4426950408889634
_MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b in float32; IEEE keeps float32 inputs out of TF32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _to_cache(x, cache_ptr, scale_ptr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """x as ``cache_ptr``'s cache stores it: cast, or (fp8) divided by the scale (rounded to
    nearest, like torch's division), saturated to the format's range, then cast."""
    if KV_FP8:
        y = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(cache_ptr.dtype.element_ty)
    else:
        return x.to(cache_ptr.dtype.element_ty)


# ----------------------------------------------------------------------------------------------
# KV write
# ----------------------------------------------------------------------------------------------


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    mask = heads[:, None] < tl.where(slot >= 0, num_kv_heads, 0)  # a negative slot writes nothing
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, _to_cache(k, k_cache_ptr, k_scale_ptr, KV_FP8, FP8_MAX), mask=mask)
    tl.store(v_cache_ptr + dst, _to_cache(v, v_cache_ptr, v_scale_ptr, KV_FP8, FP8_MAX), mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store k, v ([T, num_kv_heads, head_dim]) at the flat cache slots of slot_mapping ([T] int64);
    rows whose slot is negative are skipped. An fp8 cache stores them quantised by k_scale and
    v_scale."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _check_cache_pair(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _check_head_dim(head_dim)
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        scales.k_scale,
        scales.v_scale,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        KV_FP8=scales.fp8,
        FP8_MAX=scales.fp8_max,
        num_warps=1 if head_dim * num_kv_heads <= 512 else 4,
    )


# ----------------------------------------------------------------------------------------------
# One online-softmax step over a tile of keys
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    kv_head_offset,
    key_start,
    seq_len,
    q_pos,
    qk_scale,
    stride_cb,
    stride_cs,
    window,
    soft_cap,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    KV_FP8: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    """One online-softmax step over keys [key_start, key_start + BLOCK_N) of one sequence.

    q [BLOCK_M, D]; acc [BLOCK_M, D], m_i, l_i [BLOCK_M] in float32 (m_i in the log2 domain).
    MASKED drops keys at or past seq_len; CAUSAL (with MASKED) also keys past each row's absolute
    position q_pos [BLOCK_M]; WINDOW (with MASKED) also keys at or below q_pos - window. KV_FP8:
    the tiles are converted to q's dtype, unscaled (the caller folds k_scale into qk_scale and
    v_scale into the output). SOFT_CAP:
    scores become soft_cap * tanh(score / soft_cap), soft_cap being the cap times log2(e) as the
    scores are in the log2 domain (the same capping in nats).
    """
    keys = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    if MASKED:
        key_ok = keys < seq_len
        block = tl.load(table_row_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block = tl.load(table_row_ptr + keys // BLOCK_SIZE)
    key_offset = block.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head_offset
    if MASKED:
        k_t = tl.load(k_cache_ptr + key_offset[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + key_offset[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
    else:
        k_t = tl.load(k_cache_ptr + key_offset[None, :] + dims[:, None])
        v = tl.load(v_cache_ptr + key_offset[:, None] + dims[None, :])
    if KV_FP8:
        k_t = k_t.to(q.dtype)
        v = v.to(q.dtype)
    scores = _dot(q, k_t, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE, INTERP) * qk_scale
    if SOFT_CAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1): finite for any x (exp overflows to inf -> 1)
        scores = soft_cap * (1.0 - 2.0 / (tl.exp(scores * (2.0 / soft_cap)) + 1.0))
    if MASKED:
        if WINDOW:
            visible = (
                key_ok[None, :] & (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_pos[:, None] - window)
            )
        elif CAUSAL:
            visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        else:
            visible = key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_ref = m_new
    if WINDOW:  # a row may see no key of this tile yet: keep its exponents finite (-inf - -inf)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, INTERP)
    return acc, m_new, l_i


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of an attention kernel. block_m: rows of a varlen program (query
    positions x padded group heads; ignored by decode); block_n: keys per step; max_registers
    (decode only): ptxas's cap on registers a thread (Triton's ``maxnreg``; None: its own count),
    more programs resident on a SM at the price of spills."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    max_registers: int | None = None


# ----------------------------------------------------------------------------------------------
# Checks (host shapes only)
# ----------------------------------------------------------------------------------------------


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 16, got {head_dim}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and strides")
    if k_cache.dim() != 4 or k_cache.stride(3) != 1:
        raise ValueError("caches must be [num_blocks, block_size, num_kv_heads, head_dim] with unit last stride")


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor | None = None) -> None:
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if q.dtype != k_cache.dtype and not kv_quant.is_fp8(k_cache.dtype):
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} with a unit last stride, got {tuple(out.shape)}")
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    _check_head_dim(head_dim)


@dataclass(frozen=True)
class KVScaleArgs:
    """A launch's view of the cache's scales: ``fp8`` (the KV_FP8 constexpr), the format's largest
    value, and the two scale tensors (the cache itself in their place when not fp8: never read)."""

    fp8: bool
    fp8_max: float
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def kv_scale_args(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> KVScaleArgs:
    if not kv_quant.is_fp8(k_cache.dtype):
        return KVScaleArgs(False, 0.0, k_cache, k_cache)
    return KVScaleArgs(
        True,
        kv_quant.fp8_max(k_cache.dtype),
        kv_quant.checked_scale(k_scale, k_cache),
        kv_quant.checked_scale(v_scale, k_cache),
    )


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def checked_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention call's q (with a unit last stride) and out (like q when None), once the
    shapes of q, the caches and out are checked."""
    _check_cache_pair(k_cache, v_cache)
    _check_shapes(q, k_cache, out)
    q = _last_dim_contiguous(q)
    return q, torch.empty_like(q) if out is None else out
