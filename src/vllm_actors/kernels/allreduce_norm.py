"""One kernel for a tensor-parallel all-reduce and the add + RMSNorm after it (Triton, NVLink peers).

Each row-parallel projection (``o_proj``, ``down_proj``) ends in an all-reduce of its partial sums,
and the next thing the decoder does is add the residual stream and RMSNorm the sum. With NCCL that
is two kernels and a launch gap, twice a layer; at batch 1 NCCL's latency, not the bytes, sets the cost.

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

The default on GPUs is the *flagless* kernel (``lamport=True``), the one-shot "Lamport" all-reduce
of TensorRT-LLM: every slot holds EMPTY (all bits set) between calls; program ``p`` stores its rows
into its rank's region of every peer's slot, then reads each peer's region of its own slot until
no element is EMPTY any more (a row is its own flag), sets it back to EMPTY and sums in rank order
as above. One NVLink crossing a call, where the flagged kernel has a store, a system-scope release
and a compare-and-swap round trip. Reuse is safe for the same reason: a peer stores into slot ``s``
again only after a call on another slot, which needs this rank's rows of that call, which this
rank sends only after the kernel that emptied ``s`` has finished. It is the faster of the two at
every batch size measured (``benchmarks/RESULTS.md``).

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
    from vllm_actors.kernels import pdl as pdl_module
    from vllm_actors.kernels.pdl import pdl, pdl_enter

    @triton.jit
    def _add_norm_store(total, row, cols, mask, residual_ptr, out_ptr, residual_out_ptr, weight, n_cols,
                        stride_r, stride_o, stride_ro, eps, HAS_RESIDUAL: tl.constexpr, res, RES_LOADED: tl.constexpr):
        """The float32 sum of a row, rounded to the activation dtype, plus the residual (``res`` when
        RES_LOADED: read before the PDL wait), normalised."""
        dtype = out_ptr.dtype.element_ty
        x = total.to(dtype).to(tl.float32)
        if HAS_RESIDUAL:
            if not RES_LOADED:
                res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
            x += res.to(tl.float32)
            x = x.to(dtype).to(tl.float32)  # the residual stream is kept in the activation dtype
        tl.store(residual_out_ptr + row * stride_ro + cols, x.to(dtype), mask=mask)
        variance = tl.sum(x * x, axis=0) / n_cols
        normed = (x * tl.rsqrt(variance + eps)).to(dtype)
        tl.store(out_ptr + row * stride_o + cols, weight * normed, mask=mask)

    @triton.jit
    def _early_loads(residual_ptr, weight_ptr, row, cols, mask, stride_r, HAS_RESIDUAL: tl.constexpr,
                     EARLY: tl.constexpr, BLOCK: tl.constexpr):
        """(residual row, norm weight) loaded before the PDL wait when EARLY (the program has one row,
        whose residual a kernel two or more launches back wrote), else placeholders."""
        res = tl.zeros([BLOCK], dtype=residual_ptr.dtype.element_ty)
        weight = tl.zeros([BLOCK], dtype=weight_ptr.dtype.element_ty)
        if EARLY:
            weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                res = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        return res, weight

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
        PDL: tl.constexpr,
        BLOCK: tl.constexpr,
        EARLY: tl.constexpr,  # one row a program: the residual row and the weight read before the PDL wait
    ):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = x_ptr.dtype.element_ty
        res, weight = _early_loads(residual_ptr, weight_ptr, pid, cols, mask, stride_r, HAS_RESIDUAL, EARLY, BLOCK)
        pdl_enter(PDL)
        mine = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype))
        for row in range(pid, n_rows, programs):  # 1. this rank's rows into its buffer
            part = tl.load(x_ptr + row * stride_x + cols, mask=mask)
            tl.store(mine + row * n_cols + cols, part, mask=mask)
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
        if not EARLY:
            weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        for row in range(pid, n_rows, programs):  # 3. sum in rank order, add, normalise
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for peer in tl.static_range(WORLD):
                src = tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype))
                total += tl.load(src + row * n_cols + cols, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
            _add_norm_store(total, row, cols, mask, residual_ptr, out_ptr, residual_out_ptr, weight, n_cols,
                            stride_r, stride_o, stride_ro, eps, HAS_RESIDUAL, res, EARLY)

    @triton.jit
    def _as_bits(v, ELEM_BITS: tl.constexpr):
        if ELEM_BITS == 16:
            return v.to(tl.int16, bitcast=True)
        else:
            return v.to(tl.int32, bitcast=True)

    @triton.jit
    def _bits_full(BLOCK: tl.constexpr, value: tl.constexpr, ELEM_BITS: tl.constexpr):
        if ELEM_BITS == 16:
            return tl.full([BLOCK], value, tl.int16)
        else:
            return tl.full([BLOCK], value, tl.int32)

    @triton.jit
    def _all_reduce_rms_norm_lamport_kernel(
        x_ptr,
        buffer_ptrs,  # int64 [WORLD]: this call's slot in every rank's buffer, all ones (EMPTY) between calls
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
        PDL: tl.constexpr,
        BLOCK: tl.constexpr,
        ELEM_BITS: tl.constexpr,
        EARLY: tl.constexpr,  # one row a program: the residual row and the weight read before the PDL wait
    ):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = x_ptr.dtype.element_ty
        res, weight = _early_loads(residual_ptr, weight_ptr, pid, cols, mask, stride_r, HAS_RESIDUAL, EARLY, BLOCK)
        pdl_enter(PDL)
        empty = _bits_full(BLOCK, -1, ELEM_BITS)  # all ones: a NaN that no row carries
        mine = tl.load(buffer_ptrs + RANK).to(tl.pointer_type(dtype))
        for row in range(pid, n_rows, programs):  # 1. this rank's rows into its region of every peer's slot
            bits = _as_bits(tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0), ELEM_BITS)
            bits = tl.where(bits == empty, _bits_full(BLOCK, -2, ELEM_BITS), bits)  # that NaN becomes another
            for peer in tl.static_range(WORLD):
                if peer != RANK:
                    region = tl.load(buffer_ptrs + peer).to(tl.pointer_type(dtype)) + RANK * n_rows * n_cols
                    tl.store(region + row * n_cols + cols, bits.to(dtype, bitcast=True), mask=mask)
        tl.debug_barrier()
        if not EARLY:
            weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
        for row in range(pid, n_rows, programs):  # 2. each peer's row as it lands, in rank order; add, normalise
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for peer in tl.static_range(WORLD):
                if peer == RANK:
                    total += tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
                else:
                    src = mine + peer * n_rows * n_cols + row * n_cols + cols
                    value = tl.load(src, mask=mask, other=0.0, volatile=True)
                    while tl.max(tl.where(_as_bits(value, ELEM_BITS) == empty, 1, 0), axis=0) > 0:
                        value = tl.load(src, mask=mask, other=0.0, volatile=True)
                    tl.store(src, empty.to(dtype, bitcast=True), mask=mask)  # EMPTY again for the slot's next use
                    total += value.to(tl.float32)
            _add_norm_store(total, row, cols, mask, residual_ptr, out_ptr, residual_out_ptr, weight, n_cols,
                            stride_r, stride_o, stride_ro, eps, HAS_RESIDUAL, res, EARLY)


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
    lamport: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's partial ``x`` [rows, cols] summed over the ranks, plus ``residual``, normalised:
    (RMSNorm(sum + residual) * weight, sum + residual), new tensors.

    ``buffer_ptrs``, ``pad_ptrs``: int64 tensors on ``x``'s device with, for every rank, the address
    of this call site's slot of its buffer (room for ``x``, contiguous) and of its signal pad (room
    for ``programs_for(rows) * world`` int32 flags, zero between calls). Every rank must make the
    same call with the same shape.

    ``lamport``: no flags and no barrier (``pad_ptrs`` unused). Each rank stores its rows into its
    region of every peer's slot (rank-major: room for ``world`` times ``x``) and reads each peer's region of its own
    slot until no element holds the EMPTY pattern (all bits set), then sets it back to EMPTY. A row
    is its own flag, as in the one-shot "Lamport" all-reduce of TensorRT-LLM: one NVLink crossing a
    call instead of a store, a release fence and a compare-and-swap round trip. The slots must hold
    EMPTY when first used; a NaN with that bit pattern is sent as another NaN."""
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
    early = pdl_module.early_loads() and rows <= MAX_PROGRAMS  # then every program has exactly one row
    if lamport:
        if x.element_size() not in (2, 4):
            raise ValueError(f"the flagless all-reduce takes 16- or 32-bit elements, got {x.dtype}")
        _all_reduce_rms_norm_lamport_kernel[(programs_for(rows),)](
            x, buffer_ptrs, source, out, residual_out, weight, rows, cols,
            x.stride(0), source.stride(0), out.stride(0), residual_out.stride(0), eps,
            RANK=rank, WORLD=world, HAS_RESIDUAL=residual is not None, **pdl(x),
            BLOCK=triton.next_power_of_2(cols), ELEM_BITS=8 * x.element_size(), EARLY=early,
            num_warps=8 if cols >= 4096 else 4,
        )
        return out, residual_out
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
        **pdl(x),
        BLOCK=triton.next_power_of_2(cols),
        EARLY=early,
        num_warps=8 if cols >= 4096 else 4,
    )
    return out, residual_out
