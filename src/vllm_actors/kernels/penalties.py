"""vLLM's repetition, frequency and presence penalties in one pass over the penalised rows (Triton).

For each penalised row the logits are read once, with the row's prompt-seen flags and output
counts from the worker's ``PenaltyPool``, and written back once, in place:

    penalty = repetition if the token is in the prompt or the output else 1
    logit   = logit / penalty if logit > 0 else logit * penalty
    logit  -= frequency * count + presence * (count > 0)

In torch that is a gather of the rows, two gathers of the pool's rows and about ten elementwise
passes over rows x vocabulary (about 2.5 GB of traffic for 230 rows of a 152k vocabulary); here
it is one read of each input and one write (about 0.45 GB). ``rows`` maps each penalised row to
its logits row and ``slots`` to its pool slot, so the pool's tensors are read where they are.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False

_BLOCK = 2048


if HAVE_TRITON:

    @triton.jit
    def _penalties_kernel(
        logits_ptr,
        logits_stride,
        rows_ptr,
        slots_ptr,
        seen_ptr,
        counts_ptr,
        pool_stride,
        scalars_ptr,
        num_rows,
        vocab_size,
        BLOCK: tl.constexpr,
    ):
        """Program (i, block): penalised row i's slice ``block`` of the vocabulary."""
        i = tl.program_id(0)
        offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < vocab_size
        row = tl.load(rows_ptr + i).to(tl.int64)
        slot = tl.load(slots_ptr + i).to(tl.int64)
        repetition = tl.load(scalars_ptr + i)
        frequency = tl.load(scalars_ptr + num_rows + i)
        presence = tl.load(scalars_ptr + 2 * num_rows + i)
        where = logits_ptr + row * logits_stride + offsets
        logits = tl.load(where, mask=inside, other=0.0)
        seen = tl.load(seen_ptr + slot * pool_stride + offsets, mask=inside, other=0) != 0
        count = tl.load(counts_ptr + slot * pool_stride + offsets, mask=inside, other=0.0)
        generated = count > 0
        penalty = tl.where(seen | generated, repetition, 1.0)
        logits = tl.where(logits > 0, logits / penalty, logits * penalty)
        logits = logits - frequency * count - presence * generated.to(tl.float32)
        tl.store(where, logits, mask=inside)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, prompt_seen: torch.Tensor,
                    output_counts: torch.Tensor, scalars: torch.Tensor) -> None:
    """Penalise ``logits`` [N, V] float32 in place: row ``rows[i]`` with pool slot ``slots[i]``
    (int64 [n]) of ``prompt_seen`` (bool [S, V]) and ``output_counts`` (float32 [S, V]), by
    ``scalars`` float32 [3, n] (repetition, frequency, presence per row). All on one device."""
    num_rows = rows.shape[0]
    vocab = logits.shape[1]
    if not num_rows:
        return
    if logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError("apply_penalties wants contiguous float32 logits rows")
    same_layout = prompt_seen.stride(0) == output_counts.stride(0)
    if prompt_seen.shape[1] != vocab or output_counts.shape[1] != vocab or not same_layout:
        raise ValueError(f"the pool's rows ({tuple(prompt_seen.shape)}, {tuple(output_counts.shape)}) do not match "
                         f"logits of {vocab} tokens")
    grid = (num_rows, triton.cdiv(vocab, _BLOCK))
    _penalties_kernel[grid](logits, logits.stride(0), rows, slots, prompt_seen.view(torch.uint8), output_counts,
                            output_counts.stride(0), scalars.contiguous(), num_rows, vocab, BLOCK=_BLOCK)


def apply_penalties_torch(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, prompt_seen: torch.Tensor,
                          output_counts: torch.Tensor, scalars: torch.Tensor) -> None:
    """The same in torch (the reference, and the path without Triton)."""
    seen = prompt_seen.index_select(0, slots)
    counts = output_counts.index_select(0, slots)
    generated = counts > 0
    repetition, frequency, presence = (column.unsqueeze(1) for column in scalars)
    sub = logits.index_select(0, rows)
    penalty = torch.where(seen | generated, repetition, torch.ones_like(repetition))
    sub = torch.where(sub > 0, sub / penalty, sub * penalty)
    sub = sub - frequency * counts - presence * generated.to(sub.dtype)
    logits.index_copy_(0, rows, sub)
