"""Batched LoRA for a few tokens (decode at small batch sizes): one program per token row, no sort.

``y[t] += (x[t] @ A[s].T) @ B[s].T`` with ``s`` the token's slot (-1: row untouched), in two
launches with nothing between them (no zero-fill, no atomics: the same sums in the same order on
every run):

- shrink: grid (T, SPLIT, rank blocks); each program multiplies one K piece of its row by the
  slot's A and stores its partial sums in ``parts[split, t]`` (float32; float64 for float64
  inputs). K is cut into many short pieces, so each program issues its loads at once instead of
  walking K in a loop: at one token the shrink's time is one load's latency, not K / 64 of them;
- expand: grid (T, N blocks); each program sums its row's SPLIT partials (a few KB, from L2),
  rounds them to the model's dtype for bf16/fp16 models (as the sorted kernels' expand), and adds
  their product with its tile of the slot's B into ``y``.

The products are element-wise with float32 (float64) sums, not ``tl.dot``: exact products of the
inputs, so float32 runs are IEEE like the sorted kernels' ``input_precision="ieee"``.

Under programmatic dependent launch (``kernels/pdl.py``) each program reads its slot and loads its
first weight tile (A or B: written by no kernel of the step) before it waits for its predecessor,
and every program waits, also those of rows without an adapter, before it returns: a kernel that
ended without waiting could complete before the one before it, and the next one would read early.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    from vllm_actors.kernels.pdl import pdl, pdl_enter

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False

MAX_SPLIT = 64  # K pieces per row at most (the expand sums them in one [SPLIT, BLOCK_R] tile)
TILE = 8192  # elements of one shrink program's A tile (16 KB in bf16)


def _blocks(rank: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_R, BLOCK_K, SPLIT, K_PER_SPLIT) for a stacked rank ``rank`` and ``k`` inputs."""
    block_r = min(triton.next_power_of_2(rank), 64)
    block_k = max(64, min(512, TILE // block_r))
    chunks = triton.cdiv(k, block_k)
    per_split = triton.cdiv(chunks, min(chunks, MAX_SPLIT))  # BLOCK_K pieces per program
    return block_r, block_k, triton.cdiv(chunks, per_split), per_split * block_k


def lora_rows(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor) -> None:
    """``y`` [T, N] += the low-rank product of ``x`` [T, K] through slots ``a`` [L, R, K], ``b``
    [L, N, R], each row through its slot in ``token_slots`` [T] (-1: untouched)."""
    tokens, k = x.shape
    _, rank, _ = a.shape
    n = b.shape[1]
    if tokens == 0:
        return
    block_r, block_k, split, k_per_split = _blocks(rank, k)
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    parts = torch.empty((split, tokens, rank), dtype=acc_dtype, device=x.device)
    _rows_shrink_kernel[(tokens, split, triton.cdiv(rank, block_r))](
        x, a, parts, token_slots, k, rank, k_per_split,
        x.stride(0), a.stride(0), a.stride(1), parts.stride(0), parts.stride(1),
        BLOCK_R=block_r, BLOCK_K=block_k, **pdl(x),
    )  # fmt: skip
    _rows_expand_kernel[(tokens, triton.cdiv(n, 64))](
        parts, b, y, token_slots, n, rank,
        parts.stride(0), parts.stride(1), b.stride(0), b.stride(1), y.stride(0),
        SPLIT=split, SPLIT_P2=triton.next_power_of_2(split), BLOCK_N=64, BLOCK_R=block_r,
        LOW_PRECISION=y.dtype in (torch.bfloat16, torch.float16), **pdl(x),
    )  # fmt: skip


if HAVE_TRITON:

    @triton.jit
    def _rows_shrink_kernel(x_ptr, a_ptr, parts_ptr, slots_ptr, K, R, K_PER_SPLIT,
                            stride_x, stride_al, stride_ar, stride_ps, stride_pt,
                            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        row, pid_k, pid_r = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        slot = tl.load(slots_ptr + row)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(K, k_start + K_PER_SPLIT)
        first = tl.where(slot >= 0, k_end, 0)  # a row without an adapter loads nothing
        offs_k = k_start + tl.arange(0, BLOCK_K)
        a_rows = a_ptr + slot * stride_al + offs_r[:, None] * stride_ar
        a = tl.load(a_rows + offs_k[None, :], mask=r_mask[:, None] & (offs_k < first)[None, :], other=0.0)
        pdl_enter(PDL)  # the weights above: loaded while the kernel before finishes
        if slot < 0:
            return
        acc = tl.zeros((BLOCK_R,), dtype=parts_ptr.dtype.element_ty)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < k_end, other=0.0)
            acc += tl.sum(a.to(acc.dtype) * x.to(acc.dtype)[None, :], axis=1)
            offs_next = offs_k + BLOCK_K  # the next piece's A (none after the last: all masked)
            a = tl.load(a_rows + offs_next[None, :], mask=r_mask[:, None] & (offs_next < k_end)[None, :], other=0.0)
        tl.store(parts_ptr + pid_k * stride_ps + row * stride_pt + offs_r, acc, mask=r_mask)

    @triton.jit
    def _rows_expand_kernel(parts_ptr, b_ptr, y_ptr, slots_ptr, N, R,
                            stride_ps, stride_pt, stride_bl, stride_bn, stride_y,
                            SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_R: tl.constexpr, LOW_PRECISION: tl.constexpr, PDL: tl.constexpr):
        row, pid_n = tl.program_id(0), tl.program_id(1)
        slot = tl.load(slots_ptr + row)
        first = tl.where(slot >= 0, R, 0)  # a row without an adapter loads nothing
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        offs_s = tl.arange(0, SPLIT_P2)
        s_mask = offs_s < SPLIT
        offs_r = tl.arange(0, BLOCK_R)
        b_rows = b_ptr + slot * stride_bl + offs_n[:, None] * stride_bn
        b = tl.load(b_rows + offs_r[None, :], mask=n_mask[:, None] & (offs_r < first)[None, :], other=0.0)
        pdl_enter(PDL)
        if slot < 0:
            return
        acc = tl.zeros((BLOCK_N,), dtype=parts_ptr.dtype.element_ty)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < R
            parts = tl.load(parts_ptr + offs_s[:, None] * stride_ps + row * stride_pt + offs_r[None, :],
                            mask=s_mask[:, None] & r_mask[None, :], other=0.0)
            inter = tl.sum(parts, axis=0)  # this row's x @ A.T, rank columns r0..r0+BLOCK_R
            if LOW_PRECISION:  # rounded to the model's dtype, as the sorted kernels' expand
                inter = inter.to(b.dtype).to(acc.dtype)
            acc += tl.sum(b.to(acc.dtype) * inter[None, :], axis=1)
            offs_next = offs_r + BLOCK_R  # the next rank block's B (none after the last: all masked)
            b = tl.load(b_rows + offs_next[None, :], mask=n_mask[:, None] & (offs_next < R)[None, :], other=0.0)
        y_ptrs = y_ptr + row * stride_y + offs_n
        y = tl.load(y_ptrs, mask=n_mask, other=0.0)
        tl.store(y_ptrs, (y.to(acc.dtype) + acc).to(y.dtype), mask=n_mask)
