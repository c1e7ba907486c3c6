"""The flash-attn key split's partials merged in one launch (``flash_attn_split``): the split query's rows
of the step call's output, merged in place with the ranges' outputs by their log-sum-exp.

Per layer the torch form (``merge_into_torch``) is a dozen ops (cat, logsumexp, exp, where, sum, casts, an
indexed write): ~0.4 ms of host launch a layer, 6 ms of a 16-layer split step measured on the H200 beside
its ~25 ms of launch in all. Here one program per (query row, head) reads its ``num_splits + 1`` partials
and writes the merged row over the step call's; one compiled variant serves every split count.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton ships with the CUDA torch builds
    HAVE_TRITON = False


# the arguments that vary from step to step: never specialised on (Triton compiles a variant per value of 1
# and per divisibility by 16 otherwise)
UNSPECIALISED = ["q_start", "q_len", "num_splits", "stride_lh", "stride_slh"]

if HAVE_TRITON:

    # One compiled variant for every step: the ranges are walked in blocks of PARTS with the count a runtime
    # value, and no integer argument is specialised (a variant per split count or divisibility of the LSE
    # strides compiled mid-serving: 180-380 ms steps beside a 1M-token prefill on the H200, session 25).
    @triton.jit(do_not_specialize=UNSPECIALISED)
    def _merge_split_rows_kernel(out_ptr, lse_ptr, split_out_ptr, split_lse_ptr, q_start, q_len, num_splits,
                                 stride_ot, stride_oh, stride_lh, stride_st, stride_sh, stride_slh, head_dim,
                                 PARTS: tl.constexpr, DIM: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        parts = tl.arange(0, PARTS)
        dims = tl.arange(0, DIM)
        dim_ok = dims < head_dim
        token = (q_start + row).to(tl.int64)
        row_ptr = out_ptr + token * stride_ot + head * stride_oh + dims
        own_lse = tl.load(lse_ptr + head * stride_lh + token)
        top = own_lse
        for first in range(0, num_splits, PARTS):  # the largest LSE of the step call's part and the ranges'
            ranged = first + parts < num_splits
            split_rows = (first + parts).to(tl.int64) * q_len + row
            lses = tl.load(split_lse_ptr + head * stride_slh + split_rows, mask=ranged, other=float("-inf"))
            top = tl.maximum(top, tl.max(lses, 0))
        top = tl.where(top == float("-inf"), 0.0, top)  # every part empty: weights 0, output 0
        total = tl.exp(own_lse - top)
        merged = tl.load(row_ptr, mask=dim_ok, other=0.0).to(tl.float32) * total
        for first in range(0, num_splits, PARTS):
            ranged = first + parts < num_splits
            split_rows = (first + parts).to(tl.int64) * q_len + row
            weights = tl.exp(tl.load(split_lse_ptr + head * stride_slh + split_rows, mask=ranged,
                                     other=float("-inf")) - top)
            outs = tl.load(split_out_ptr + split_rows[:, None] * stride_st + head * stride_sh + dims[None, :],
                           mask=ranged[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
            merged += tl.sum(outs * weights[:, None], 0)
            total += tl.sum(weights, 0)
        merged = merged / tl.where(total > 0, total, 1.0)
        tl.store(row_ptr, merged.to(out_ptr.dtype.element_ty), mask=dim_ok)


PARTS = 16  # ranges a loop iteration reads (the split plans up to flash_attn_split.MAX_SPLITS)


def launch_scalars(out: torch.Tensor, lse: torch.Tensor, q_start: int, q_len: int, num_splits: int,
                   split_out: torch.Tensor, split_lse: torch.Tensor) -> dict[str, int]:
    """The kernel's integer and constexpr arguments for one merge (what decides its compiled variant)."""
    return {"q_start": q_start, "q_len": q_len, "num_splits": num_splits, "stride_ot": out.stride(0),
            "stride_oh": out.stride(1), "stride_lh": lse.stride(0), "stride_st": split_out.stride(0),
            "stride_sh": split_out.stride(1), "stride_slh": split_lse.stride(0), "head_dim": out.shape[2],
            "PARTS": PARTS, "DIM": triton.next_power_of_2(out.shape[2])}


def merge_split_rows(out: torch.Tensor, lse: torch.Tensor, q_start: int, q_len: int, num_splits: int,
                     split_out: torch.Tensor, split_lse: torch.Tensor) -> torch.Tensor:
    """``out`` [T, H, D] with rows ``[q_start, q_start + q_len)`` merged in place from the step call's
    (``lse`` [H, T]) and ``num_splits`` ranges' (``split_out`` [S * q_len, H, D], ``split_lse`` [H, S * q_len],
    range s's rows at ``s * q_len``), accumulated in float32. One Triton launch."""
    if q_len == 0:
        return out
    for name, t in (("out", out), ("split_out", split_out), ("lse", lse), ("split_lse", split_lse)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit last stride, got {t.stride()}")
    _merge_split_rows_kernel[(q_len, out.shape[1])](
        out, lse, split_out, split_lse, **launch_scalars(out, lse, q_start, q_len, num_splits, split_out, split_lse),
        num_warps=4,
    )
    return out
