"""One kernel for a tensor-parallel all-reduce and the add + RMSNorm after it (Triton, NVLink peers).

Each row-parallel projection (``o_proj``, ``down_proj``) ends in an all-reduce of its partial sums,
and the next thing the decoder does is add the residual stream and RMSNorm the sum. With NCCL that
is two kernels and a launch gap; at batch 1 (8 KiB a rank at the Qwen3-8B shape) NCCL alone takes
about 12 us in a CUDA graph, 73 times a token.

``all_reduce_rms_norm`` does it in one launch over buffers every rank maps (torch's symmetric
memory, no NVLink multicast). Program ``p`` of each rank handles rows ``p, p + G, ...``:

1. it copies its rows of this rank's partial into this rank's buffer;
2. it meets program ``p`` of every peer at a barrier of flags in the signal pads: it sets its flag
   in each peer's pad (compare-and-swap 0 -> 1, release, system scope, spinning while the peer has
   not yet consumed the previous one) and waits for each peer's flag in its own pad (1 -> 0,
   acquire), so the pads are back to zero after every call;
3. it sums the rows of every rank's buffer in rank order (float32, the same order on every rank, so
   every rank gets the same bits), rounds the sum to the activation dtype (as an all-reduce in that
   dtype would), adds the residual and normalises.

A buffer may be written again only once every peer has finished reading it. Consecutive calls
therefore alternate between buffer *slots* (the caller gives each call site its own): by the time a
rank writes slot ``s`` again it has passed another call's barrier, which its peers reach only after
their previous kernel (the one that read slot ``s``) has finished.

``all_reduce_rms_norm_reference`` is the same in torch, over a list of every rank's partial.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False

MAX_PROGRAMS = 128  # at most one program per SM of an H100 (132): every program is resident, none waits for a slot


def all_reduce_rms_norm_reference(
    partials: list[torch.Tensor], weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(sum + residual) * weight, sum + residual) with the sum of ``partials`` taken in
    float32 in list order and rounded to their dtype first, as the kernel does."""
    total = partials[0].float()
    for part in partials[1:]:
        total = total + part.float()
    x = total.to(partials[0].dtype)
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), x


if HAVE_TRITON:

    @triton.jit
    def _all_reduce_rms_norm_kernel(
        x_ptr,
        buffer_ptrs,  # int64 [WORLD]: the address of this call's slot in every rank's buffer
        pad_ptrs,  # int64 [WORLD]: every rank's signal pad (int32 flags, [program][source rank])
        residual_ptr,
        out_ptr,
        residual_out_ptr,
        weight_ptr,
        n_rows,
        n_cols,
        stride_x,
        stride_r,
        stride_o,
        stride_ro,
        eps,
        RANK: tl.constexpr,
        WORLD: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = x_ptr.dtype.element_ty
        mine = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype))
        for row in range(pid, n_rows, programs):  # 1. this rank's rows into its buffer
            tl.store(mine + row * n_cols + cols, tl.load(x_ptr + row * stride_x + cols, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's stores before the flags that publish them
        own_pad = tl.load(pad_ptrs + RANK).to(tl.pointer_type(tl.int32))
        for peer in tl.static_range(WORLD):  # 2. the barrier with program pid of every peer
            if peer != RANK:
                flag = tl.load(pad_ptrs + peer).to(tl.pointer_type(tl.int32)) + pid * WORLD + RANK
                seen = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
                while seen != 0:
                    seen = tl.atomic_cas(flag, 0, 1, sem="release", scope="sys")
        for peer in tl.static_range(WORLD):
            if peer != RANK:
                flag = own_pad + pid * WORLD + peer
                seen = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
                while seen != 1:
                    seen = tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys")
        tl.debug_barrier()
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        for row in range(pid, n_rows, programs):  # 3. sum in rank order, add, normalise
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for peer in tl.static_range(WORLD):
                src = tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype))
                total += tl.load(src + row * n_cols + cols, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
            x = total.to(dtype).to(tl.float32)
            if HAS_RESIDUAL:
                x += tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
                x = x.to(dtype).to(tl.float32)  # the residual stream is kept in the activation dtype
            tl.store(residual_out_ptr + row * stride_ro + cols, x.to(dtype), mask=mask)
            variance = tl.sum(x * x, axis=0) / n_cols
            normed = (x * tl.rsqrt(variance + eps)).to(dtype)
            tl.store(out_ptr + row * stride_o + cols, weight * normed, mask=mask)


def programs_for(rows: int) -> int:
    """Programs of one call (each needs ``world`` flags of every rank's signal pad)."""
    return max(1, min(rows, MAX_PROGRAMS))


def all_reduce_rms_norm(
    x: torch.Tensor,
    buffer_ptrs: torch.Tensor,
    pad_ptrs: torch.Tensor,
    rank: int,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial ``x`` [rows, cols] summed over the ranks, plus ``residual``, normalised:
    (RMSNorm(sum + residual) * weight, sum + residual), new tensors.

    ``buffer_ptrs``, ``pad_ptrs``: int64 tensors on ``x``'s device with, for every rank, the address
    of this call site's slot of its buffer (room for ``x``, contiguous) and of its signal pad (room
    for ``programs_for(rows) * world`` int32 flags, zero between calls). Every rank must make the
    same call with the same shape."""
    if not HAVE_TRITON:  # pragma: no cover
        raise RuntimeError("the fused all-reduce needs triton")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, cols] with contiguous rows, got shape {tuple(x.shape)}")
    world = buffer_ptrs.numel()
    if pad_ptrs.numel() != world or not 0 <= rank < world:
        raise ValueError(f"rank {rank} and {pad_ptrs.numel()} signal pads for {world} buffers")
    rows, cols = x.shape
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x)
    if rows == 0:
        return out, residual_out
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != {tuple(x.shape)}")
    source = residual if residual is not None else x
    _all_reduce_rms_norm_kernel[(programs_for(rows),)](
        x,
        buffer_ptrs,
        pad_ptrs,
        source,
        out,
        residual_out,
        weight,
        rows,
        cols,
        x.stride(0),
        source.stride(0),
        out.stride(0),
        residual_out.stride(0),
        eps,
        RANK=rank,
        WORLD=world,
        HAS_RESIDUAL=residual is not None,
        BLOCK=triton.next_power_of_2(cols),
        num_warps=8 if cols >= 4096 else 4,
    )
    return out, residual_out
