"""The vocabulary-parallel embedding lookup in one kernel (Triton on a GPU, torch elsewhere).

Under tensor parallelism each rank holds rows ``[start, start + rows)`` of the embedding table;
a token outside them embeds to zeros, and the ranks' rows are summed by the first norm's
all-reduce. In torch that is seven kernels at every step (the shift, two comparisons, their or, a
masked fill of the ids, the lookup and a masked fill of the rows); ``shard_embedding`` is one.
"""

from __future__ import annotations

import torch

from vllm_actors.kernels.fused_ops import use_triton

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False


def shard_embedding_torch(input_ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """Rows ``input_ids - start`` of ``weight``; zeros for ids outside ``[start, start + len(weight))``."""
    local = input_ids - start
    outside = (local < 0) | (local >= weight.shape[0])
    x = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    return x.masked_fill(outside.unsqueeze(-1), 0.0)


if HAVE_TRITON:
    from vllm_actors.kernels.pdl import pdl, pdl_enter

    @triton.jit
    def _shard_embedding_kernel(ids_ptr, weight_ptr, out_ptr, start, rows, dim, stride_w, stride_o,
                                BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (token, column block): the token's row of this rank's table, or zeros."""
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < dim
        pdl_enter(PDL)
        local = tl.load(ids_ptr + token).to(tl.int64) - start
        inside = (local >= 0) & (local < rows)
        load = mask & ((cols * 0 + inside.to(tl.int32)) != 0)  # a block-wide mask (the interpreter takes no scalar)
        row = tl.load(weight_ptr + tl.where(inside, local, 0) * stride_w + cols, mask=load, other=0.0)
        tl.store(out_ptr + token.to(tl.int64) * stride_o + cols, row, mask=mask)


_BLOCK = 1024


def shard_embedding(input_ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """``shard_embedding_torch`` in one launch on a GPU (same values: rows are copied, not computed)."""
    if not use_triton(weight) or input_ids.numel() == 0 or weight.stride(1) != 1:
        return shard_embedding_torch(input_ids, weight, start)
    ids = input_ids.reshape(-1)
    rows, dim = weight.shape
    out = torch.empty((ids.shape[0], dim), dtype=weight.dtype, device=weight.device)
    _shard_embedding_kernel[(ids.shape[0], triton.cdiv(dim, _BLOCK))](
        ids, weight, out, start, rows, dim, weight.stride(0), out.stride(0), BLOCK=_BLOCK, **pdl(weight),
        num_warps=4,
    )
    return out.view(*input_ids.shape, dim)
