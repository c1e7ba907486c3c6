"""The flash-attn key split's partials merged in one launch (``flash_attn_split``): the split query's rows
of the step call's output, merged in place with the ranges' outputs by their log-sum-exp.

Per layer the torch form (``merge_into_torch``) is a dozen ops (cat, logsumexp, exp, where, sum, casts, an
indexed write): ~0.4 ms of host launch a layer, 6 ms of a 16-layer split step measured on the H200 beside
its ~25 ms of launch in all. Here one program per (query row, head) reads its ``num_splits + 1`` partials
and writes the merged row over the step call's.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with the CUDA torch builds
    HAVE_TRITON = False


if HAVE_TRITON:

    @triton.jit
    def _merge_split_rows_kernel(out_ptr, lse_ptr, split_out_ptr, split_lse_ptr, q_start, q_len, num_splits,
                                 stride_ot, stride_oh, stride_lh, stride_st, stride_sh, stride_slh, head_dim,
                                 PARTS: tl.constexpr, DIM: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        parts = tl.arange(0, PARTS)  # 0: the step call's partial; 1..num_splits: the ranges'
        dims = tl.arange(0, DIM)
        dim_ok = dims < head_dim
        ranged = (parts >= 1) & (parts <= num_splits)
        split_rows = (tl.maximum(parts, 1) - 1).to(tl.int64) * q_len + row
        token = (q_start + row).to(tl.int64)
        own_lse = tl.load(lse_ptr + head * stride_lh + token)
        lses = tl.load(split_lse_ptr + head * stride_slh + split_rows, mask=ranged, other=float("-inf"))
        lses = tl.where(parts == 0, own_lse, lses)
        outs = tl.load(split_out_ptr + split_rows[:, None] * stride_st + head * stride_sh + dims[None, :],
                       mask=ranged[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        row_ptr = out_ptr + token * stride_ot + head * stride_oh + dims
        own = tl.load(row_ptr, mask=dim_ok, other=0.0).to(tl.float32)
        outs = tl.where(parts[:, None] == 0, own[None, :], outs)
        top = tl.max(lses, 0)
        top = tl.where(top == float("-inf"), 0.0, top)  # every part empty: weights 0, output 0
        weights = tl.exp(lses - top)
        total = tl.sum(weights, 0)
        merged = tl.sum(outs * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(row_ptr, merged.to(out_ptr.dtype.element_ty), mask=dim_ok)


def merge_split_rows(out: torch.Tensor, lse: torch.Tensor, q_start: int, q_len: int, num_splits: int,
                     split_out: torch.Tensor, split_lse: torch.Tensor) -> torch.Tensor:
    """``out`` [T, H, D] with rows ``[q_start, q_start + q_len)`` merged in place from the step call's
    (``lse`` [H, T]) and ``num_splits`` ranges' (``split_out`` [S * q_len, H, D], ``split_lse`` [H, S * q_len],
    range s's rows at ``s * q_len``), accumulated in float32. One Triton launch."""
    num_heads, head_dim = out.shape[1], out.shape[2]
    if q_len == 0:
        return out
    for name, t in (("out", out), ("split_out", split_out), ("lse", lse), ("split_lse", split_lse)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit last stride, got {t.stride()}")
    _merge_split_rows_kernel[(q_len, num_heads)](
        out, lse, split_out, split_lse, q_start, q_len, num_splits,
        out.stride(0), out.stride(1), lse.stride(0), split_out.stride(0), split_out.stride(1), split_lse.stride(0),
        head_dim, PARTS=triton.next_power_of_2(num_splits + 1), DIM=triton.next_power_of_2(head_dim), num_warps=4,
    )  # fmt: skip
    return out
