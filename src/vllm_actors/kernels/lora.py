"""Batched LoRA: ``y[t] += (x[t] @ A[s].T) @ B[s].T`` for each token ``t`` of a batch, ``s`` its
adapter's slot (-1: no adapter, ``y[t]`` untouched). vLLM's punica kernels, two launches:

- shrink: ``buf[t] = x[t] @ A[s].T`` ([T, K] x [L, R, K] -> [T, R], float32, float64 for float64 inputs);
  for a few tokens (decode) K is split over ``SPLIT_K`` programs that add their parts atomically;
- expand: ``y[t] += buf[t] @ B[s].T`` ([T, R] x [L, N, R], added to ``y`` [T, N] in place; in the
  model's dtype for bf16/fp16 models, as vLLM, else exact).

The tokens are sorted by slot once per forward (``LoRAMetadata``: static shapes, no host read), and
each program takes ``BLOCK_M`` tokens of one slot, so a slot's weights are read once per token
block. Shapes depend on T and L only: CUDA-graph capturable. ``lora_torch`` is the same product in
torch, one slot at a time (the CPU engine's path and the tests' reference).

A step of at most ``ROW_TOKENS`` tokens (decode at small batch sizes) takes the per-row kernels of
``kernels/lora_rows.py`` instead: no sort, no zero-fill, short K pieces, two launches in all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_actors.kernels import choice
from vllm_actors.kernels.lora_rows import lora_rows

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    return choice.use_triton("VLLM_ACTORS_LORA_KERNEL", HAVE_TRITON, x.device)  # =triton: the interpreter on CPUs


class LoRAMetadata(NamedTuple):
    """A batch's tokens grouped by slot: ``sorted_tokens`` [T] (ascending slot, -1 first), and per
    slot its token count and where its run starts in ``sorted_tokens`` ([L] each)."""

    token_slots: torch.Tensor
    sorted_tokens: torch.Tensor
    counts: torch.Tensor
    starts: torch.Tensor


def lora_metadata(token_slots: torch.Tensor, num_slots: int) -> LoRAMetadata:
    """``token_slots`` [T] int: each token's slot in 0..num_slots-1, or -1. Static shapes only."""
    slots = torch.arange(num_slots, device=token_slots.device, dtype=token_slots.dtype)[:, None]
    sorted_tokens = torch.argsort(token_slots, stable=True).to(torch.int32)
    counts = (token_slots[None, :] == slots).sum(1, dtype=torch.int32)
    starts = (token_slots[None, :] < slots).sum(1, dtype=torch.int32)  # tokens of lower slots (and -1)
    return LoRAMetadata(token_slots, sorted_tokens, counts, starts)


def lora_torch(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata) -> None:
    """``y += `` each token's low-rank product, one slot at a time (reads the slots on the host)."""
    slots = meta.token_slots
    for slot in torch.unique(slots).tolist():
        if slot < 0:
            continue
        rows = torch.nonzero(slots == slot).squeeze(1)
        y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T.to(x.dtype)) @ b[slot].T.to(x.dtype))


def add_lora(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata) -> None:
    """``y`` [T, N] += the low-rank product of ``x`` [T, K] through slots ``a`` [L, R, K], ``b`` [L, N, R]."""
    if use_triton(x) and x.shape[0] <= ROW_TOKENS:
        lora_rows(x, y, a, b, meta.token_slots)
    elif use_triton(x):
        lora_expand(lora_shrink(x, a, meta), b, y, meta)
    else:
        lora_torch(x, y, a, b, meta)


# Up to this many tokens a step runs one program per token row (``lora_rows``): a decode step of a
# few sequences, where the sorted kernels' serial K loop and zero-fill cost more than re-reading a
# slot's weights once per row (from L2) does. Above it, the sorted kernels read them once per block.
ROW_TOKENS = 8
SPLIT_K = 8  # K pieces per shrink program group at few tokens: a batch-1 shrink spread over 8 programs
SPLIT_K_TOKENS = 64  # up to this many tokens


def _block_m(num_tokens: int) -> int:
    return 16 if num_tokens <= 16 else 32 if num_tokens <= 256 else 64


def lora_shrink(x: torch.Tensor, a: torch.Tensor, meta: LoRAMetadata) -> torch.Tensor:
    """[T, R] = x[t] @ a[slot(t)].T (rows of tokens without a slot: unwritten)."""
    tokens, k = x.shape
    num_slots, rank, _ = a.shape
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    split_k = SPLIT_K if tokens <= SPLIT_K_TOKENS else 1
    out = (torch.zeros if split_k > 1 else torch.empty)((tokens, rank), dtype=acc_dtype, device=x.device)
    if tokens == 0:
        return out
    block_m, block_r = _block_m(tokens), 16 if rank <= 16 else 32 if rank <= 32 else 64
    grid = (triton.cdiv(tokens, block_m), triton.cdiv(rank, block_r) * split_k, num_slots)
    _shrink_kernel[grid](
        x, a, out, meta.sorted_tokens, meta.counts, meta.starts, k, rank,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, SPLIT_K=split_k,
    )  # fmt: skip
    return out


def lora_expand(buf: torch.Tensor, b: torch.Tensor, y: torch.Tensor, meta: LoRAMetadata) -> None:
    """y[t] += buf[t] @ b[slot(t)].T, in place (tokens without a slot untouched)."""
    tokens, rank = buf.shape
    num_slots, n, _ = b.shape
    if tokens == 0:
        return
    block_m = _block_m(tokens)
    grid = (triton.cdiv(tokens, block_m), triton.cdiv(n, 64), num_slots)
    _expand_kernel[grid](
        buf, b, y, meta.sorted_tokens, meta.counts, meta.starts, n, rank,
        buf.stride(0), b.stride(0), b.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_R=16, LOW_PRECISION=y.dtype in (torch.bfloat16, torch.float16),
    )  # fmt: skip


if HAVE_TRITON:

    @triton.jit
    def _slot_rows(sorted_ptr, counts_ptr, starts_ptr, pid_m, slot, BLOCK_M: tl.constexpr):
        """This program's tokens: block ``pid_m`` of the slot's run, and which of them exist."""
        count = tl.load(counts_ptr + slot)
        offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = offs < count
        rows = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs, mask=mask, other=0)
        return rows, mask

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, out_ptr, sorted_ptr, counts_ptr, starts_ptr, K, R,
                       stride_x, stride_al, stride_ar, stride_out,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_m, pid_rk, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if pid_m * BLOCK_M >= tl.load(counts_ptr + slot):
            return
        pid_r, pid_k = pid_rk // SPLIT_K, pid_rk % SPLIT_K
        rows, m_mask = _slot_rows(sorted_ptr, counts_ptr, starts_ptr, pid_m, slot, BLOCK_M)
        offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=out_ptr.dtype.element_ty)
        k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K  # whole BLOCK_K pieces each
        k_end = tl.minimum(K, (pid_k + 1) * k_per_split)
        for k0 in range(pid_k * k_per_split, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            a = tl.load(a_ptr + slot * stride_al + offs_r[None, :] * stride_ar + offs_k[:, None],
                        mask=r_mask[None, :] & k_mask[:, None], other=0.0)
            acc = tl.dot(x, a.to(x.dtype), acc, input_precision="ieee")
        out_ptrs = out_ptr + rows[:, None] * stride_out + offs_r[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])
        else:
            tl.atomic_add(out_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])

    @triton.jit
    def _expand_kernel(buf_ptr, b_ptr, y_ptr, sorted_ptr, counts_ptr, starts_ptr, N, R,
                       stride_buf, stride_bl, stride_bn, stride_y,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       LOW_PRECISION: tl.constexpr):
        pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        if pid_m * BLOCK_M >= tl.load(counts_ptr + slot):
            return
        rows, m_mask = _slot_rows(sorted_ptr, counts_ptr, starts_ptr, pid_m, slot, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=buf_ptr.dtype.element_ty)
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < R
            buf = tl.load(buf_ptr + rows[:, None] * stride_buf + offs_r[None, :],
                          mask=m_mask[:, None] & r_mask[None, :], other=0.0)
            b = tl.load(b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn + offs_r[:, None],
                        mask=n_mask[None, :] & r_mask[:, None], other=0.0)
            if LOW_PRECISION:  # the shrink's float32 output rounded to the model's dtype: tensor cores
                acc = tl.dot(buf.to(b.dtype), b, acc)
            else:
                acc = tl.dot(buf, b.to(buf.dtype), acc, input_precision="ieee")
        mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(acc.dtype) + acc).to(y.dtype), mask=mask)
