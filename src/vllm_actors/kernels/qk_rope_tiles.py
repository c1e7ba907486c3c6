"""``qk_norm_rope`` for steps of many tokens: one program per (tile of tokens, head) instead of per
(token, head).

The per-token launch gives each program one head of one token (64-128 elements, one warp): right for
decode, where a step has few tokens, but an 8,192-token prefill chunk of a 32-head model makes about
330k programs, and the H100 spent 0.39 ms per layer on that launch (about 12x its bytes at copy speed;
benchmarks/RESULTS.md). Here a program takes ``TOKENS_PER_TILE`` tokens of one head: the same
arithmetic and rounding as the per-token kernel (each row normalised and rotated on its own), the same
in-place stores, and the same fused KV write (a negative slot writes nothing).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from vllm_actors.kernels.pdl import pdl_enter
from vllm_actors.kernels.triton_paged import _to_cache

TOKENS_PER_TILE = 32
# From this many tokens a step takes the tiled launch; fewer keep the per-token one (decode).
TILED_FROM_TOKENS = 128


@triton.jit
def _norm_rope_rows(rows_ptr, mask, cos, sin, weight_ptr, eps, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Rows' RMSNorm (HAS_NORM) and rotary for one head ([TILE, half] pointers to the first halves),
    stored in place; returns the two halves."""
    half: tl.constexpr = HEAD_DIM // 2
    offsets = tl.arange(0, half)
    x1 = tl.load(rows_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows_ptr + half, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        variance = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM
        scale = tl.rsqrt(variance + eps)[:, None]
        w1 = tl.load(weight_ptr + offsets)[None, :]
        w2 = tl.load(weight_ptr + half + offsets)[None, :]
        x1 = (w1 * (x1 * scale).to(w1.dtype)).to(tl.float32)
        x2 = (w2 * (x2 * scale).to(w2.dtype)).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(rows_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(rows_ptr.dtype.element_ty)
    tl.store(rows_ptr, y1, mask=mask)
    tl.store(rows_ptr + half, y2, mask=mask)
    return y1, y2


@triton.jit
def _qk_norm_rope_tiles_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_weight_ptr, k_weight_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_scale_ptr, v_scale_ptr, num_q_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt,
    stride_vh, stride_cos, stride_cb, stride_cs, stride_ch, eps, tokens,
    HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr, WRITE_CACHE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, PDL: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """Program (tile of TILE tokens, head) over the q heads then the k heads; a k head's program also
    stores the rotated k and the tokens' v at their cache slots (WRITE_CACHE)."""
    pdl_enter(PDL)
    half: tl.constexpr = HEAD_DIM // 2
    rows = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    head = tl.program_id(1)
    in_step = rows < tokens
    offsets = tl.arange(0, half)
    mask = in_step[:, None]
    angle = rows[:, None] * stride_cos + offsets[None, :]
    cos = tl.load(cos_ptr + angle, mask=mask, other=1.0)
    sin = tl.load(sin_ptr + angle, mask=mask, other=0.0)
    if head < num_q_heads:
        rows_ptr = q_ptr + rows[:, None] * stride_qt + head * stride_qh + offsets[None, :]
        _norm_rope_rows(rows_ptr, mask, cos, sin, q_weight_ptr, eps, HAS_NORM, HEAD_DIM)
    else:
        kv_head = head - num_q_heads
        rows_ptr = k_ptr + rows[:, None] * stride_kt + kv_head * stride_kh + offsets[None, :]
        y1, y2 = _norm_rope_rows(rows_ptr, mask, cos, sin, k_weight_ptr, eps, HAS_NORM, HEAD_DIM)
        if WRITE_CACHE:
            slot = tl.load(slot_ptr + rows, mask=in_step, other=-1).to(tl.int64)
            keep = (in_step & (slot >= 0))[:, None]
            dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None]
            tl.store(k_cache_ptr + dst + offsets[None, :], _to_cache(y1, k_cache_ptr, k_scale_ptr, KV_FP8, FP8_MAX),
                     mask=keep)
            tl.store(k_cache_ptr + dst + half + offsets[None, :],
                     _to_cache(y2, k_cache_ptr, k_scale_ptr, KV_FP8, FP8_MAX), mask=keep)
            dims = tl.arange(0, HEAD_DIM)[None, :]
            v = tl.load(v_ptr + rows[:, None] * stride_vt + kv_head * stride_vh + dims, mask=mask, other=0.0)
            tl.store(v_cache_ptr + dst + dims, _to_cache(v, v_cache_ptr, v_scale_ptr, KV_FP8, FP8_MAX), mask=keep)


def launch_tiles(q: torch.Tensor, k: torch.Tensor, arguments: tuple[Any, ...], options: dict[str, Any]) -> None:
    """The tiled launch over ``q`` [T, Hq, D] and ``k`` [T, Hk, D]: ``arguments`` and ``options`` are the
    per-token kernel's (its kernel takes the same ones, then the token count; EARLY is dropped: a tile
    reads its slots after the PDL wait, which is always safe)."""
    tokens, num_q_heads = q.shape[0], q.shape[1]
    constexprs = {name: value for name, value in options.items() if name not in ("EARLY", "num_warps")}
    grid = (triton.cdiv(tokens, TOKENS_PER_TILE), num_q_heads + k.shape[1])
    _qk_norm_rope_tiles_kernel[grid](*arguments, tokens, TILE=TOKENS_PER_TILE, num_warps=4, **constexprs)
