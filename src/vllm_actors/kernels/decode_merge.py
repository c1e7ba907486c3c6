"""The decode kernel's split-K partials merged (``triton_decode``): ``merge_splits``, one (sequence,
head)'s merge (also used by the KV-parallel reduction), and the reduce kernel that writes the outputs."""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_actors.kernels.pdl import pdl_enter


@triton.jit
def merge_splits(part_out_ptr, part_max_ptr, part_sum_ptr, seq, head, num_heads, num_splits,
                 SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One (sequence, head)'s split partials merged: (output [HEAD_DIM], the largest split max, the
    weighted sum of the splits' sums relative to it; 0 when every split is empty)."""
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part_row = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
    part_max = tl.load(part_max_ptr + part_row, mask=split_ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part_row, mask=split_ok, other=0.0)
    dims = tl.arange(0, HEAD_DIM)
    part_out = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None], other=0.0)
    global_max = tl.maximum(tl.max(part_max, 0), -1e30)  # finite even when every split is empty
    weight = tl.where(part_sum > 0, part_sum * tl.exp2(part_max - global_max), 0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(part_out * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    return out, global_max, total


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
):
    if not EARLY:
        pdl_enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_ptr + seq)
    empty = tl.load(query_start_ptr + seq + 1) <= q_row
    if EARLY:
        pdl_enter(PDL)
    if empty:
        return
    out, _, _ = merge_splits(part_out_ptr, part_max_ptr, part_sum_ptr, seq, head, num_heads, num_splits,
                             SPLITS_PAD, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))
