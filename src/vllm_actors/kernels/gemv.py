"""Matrix-vector products for batch-1 decode: ``x [M, K] @ weight[N, K].T`` for M of 1 to 4 (Triton).

A batch-1 decode step is a read of every weight once; each projection is a matrix-vector product
bound by memory. cuBLAS picks split-K kernels for the narrow shapes of a tensor-parallel shard,
plus a reduction kernel after them. Here program ``p`` owns ``BLOCK_N`` output columns and reads
their rows of the weight along K in ``BLOCK_K`` pieces, keeping a [BLOCK_N, BLOCK_K] float32
accumulator per input row that is summed once at the end: one kernel, no split-K pass, every
weight byte read once. The launch parameters are ``GemvConfig``'s, the best of a sweep
(``benchmarks/RESULTS.md``); ``VLLM_ACTORS_GEMV=0`` turns the kernel off (``linear`` is then
``F.linear``). At 4 rows cuBLAS was faster on every projection, so ``linear`` sends it 1 or 2 rows.

Under programmatic dependent launch (``kernels/pdl.py``) a one-row program loads its first
``prefetch`` weight tiles *before* it waits on the kernel before it: no kernel writes the weights,
so they may stream in while that kernel still runs (at TP=2 mostly the fused all-reduce + norm,
whose NVLink latency the loads then hide). More than 2 tiles lost to 2 (registers).

At one row the down projection reads SiLU(gate) * up itself (``silu_mul_linear``), one kernel fewer
a layer, rounded as ``silu_and_mul`` rounds it (bit-identical; ``VLLM_ACTORS_GEMV_SILU=0`` turns it off).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_actors.envs import envs

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False

MAX_ROWS = 4  # what the kernel takes
MAX_PREFETCH = 4  # weight tiles a one-row program may load before its PDL wait (registers: 4 x BLOCK_N x BLOCK_K)
TAKES_ROWS = 2  # what `linear` sends it: it beat cuBLAS at 1 and 2 rows, lost at 4


@dataclass(frozen=True)
class GemvConfig:
    # the best over the Qwen3-8B shape's projections at TP=1 and TP=2 (the sweep in benchmarks/RESULTS.md)
    block_n: int = 8
    block_k: int = 1024
    warps: int = 4
    stages: int = 2
    prefetch: int = 2  # weight tiles a one-row program loads before it waits on its predecessor (PDL)

    def __post_init__(self) -> None:
        if not 0 <= self.prefetch <= MAX_PREFETCH:  # a negative count would read before the weight rows
            raise ValueError(f"prefetch must be 0..{MAX_PREFETCH}, got {self.prefetch}")


if HAVE_TRITON:
    from vllm_actors.kernels.pdl import pdl, pdl_enter

    @triton.jit
    def _x_tile(x_ptr, k, k_mask, K, SILU_MUL: tl.constexpr):
        """Row 0 of x over ``k`` in float32; with SILU_MUL, SiLU(gate) * up rounded as silu_and_mul does."""
        if SILU_MUL:  # x is [gate | up] of 2K: SiLU in float32, to the dtype, times up
            gate = tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + K + k, mask=k_mask, other=0.0)
            return ((gate / (1.0 + tl.exp(-gate))).to(up.dtype) * up).to(tl.float32)
        return tl.load(x_ptr + k, mask=k_mask, other=0.0).to(tl.float32)

    @triton.jit
    def _w_tile(w_ptr, cols, col_mask, k, k_mask, stride_w):
        return tl.load(w_ptr + cols[:, None] * stride_w + k[None, :], mask=col_mask[:, None] & k_mask[None, :],
                       other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        N,
        K,
        stride_x,
        stride_w,
        stride_o,
        ROWS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr,
        PDL: tl.constexpr,
        SILU_MUL: tl.constexpr,  # x is [gate | up] of 2K: the product reads SiLU(gate) * up (one row)
        PREFETCH: tl.constexpr,  # one row: weight tiles loaded before pdl_enter (0 to MAX_PREFETCH)
    ):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        ks = tl.arange(0, BLOCK_K)
        # No kernel writes the weights, so they may be read before the predecessor has finished: under
        # PDL these loads overlap the kernel before (at TP > 1 the fused all-reduce + norm).
        w_a = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
        w_b = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
        w_c = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
        w_d = tl.zeros([BLOCK_N, BLOCK_K], dtype=w_ptr.dtype.element_ty)
        if PREFETCH > 0:
            w_a = _w_tile(w_ptr, cols, col_mask, ks, ks < K, stride_w)
        if PREFETCH > 1:
            w_b = _w_tile(w_ptr, cols, col_mask, BLOCK_K + ks, BLOCK_K + ks < K, stride_w)
        if PREFETCH > 2:
            w_c = _w_tile(w_ptr, cols, col_mask, 2 * BLOCK_K + ks, 2 * BLOCK_K + ks < K, stride_w)
        if PREFETCH > 3:
            w_d = _w_tile(w_ptr, cols, col_mask, 3 * BLOCK_K + ks, 3 * BLOCK_K + ks < K, stride_w)
        pdl_enter(PDL)
        wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # one row: summed over K once, at the end
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)  # rows 1..3: summed every step (registers)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
        if PREFETCH > 0:
            wide += w_a.to(tl.float32) * _x_tile(x_ptr, ks, ks < K, K, SILU_MUL)[None, :]
        if PREFETCH > 1:
            wide += w_b.to(tl.float32) * _x_tile(x_ptr, BLOCK_K + ks, BLOCK_K + ks < K, K, SILU_MUL)[None, :]
        if PREFETCH > 2:
            wide += w_c.to(tl.float32) * _x_tile(x_ptr, 2 * BLOCK_K + ks, 2 * BLOCK_K + ks < K, K, SILU_MUL)[None, :]
        if PREFETCH > 3:
            wide += w_d.to(tl.float32) * _x_tile(x_ptr, 3 * BLOCK_K + ks, 3 * BLOCK_K + ks < K, K, SILU_MUL)[None, :]
        for k0 in tl.range(PREFETCH * BLOCK_K, K, BLOCK_K, num_stages=STAGES):
            k = k0 + ks
            k_mask = k < K
            w = _w_tile(w_ptr, cols, col_mask, k, k_mask, stride_w).to(tl.float32)
            x0 = _x_tile(x_ptr, k, k_mask, K, SILU_MUL)[None, :]
            if ROWS == 1:
                wide += w * x0
            else:
                acc += tl.sum(w * x0, axis=1)
                x1 = tl.load(x_ptr + stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
                acc1 += tl.sum(w * x1[None, :], axis=1)
                if ROWS > 2:
                    x2 = tl.load(x_ptr + 2 * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
                    acc2 += tl.sum(w * x2[None, :], axis=1)
                if ROWS > 3:
                    x3 = tl.load(x_ptr + 3 * stride_x + k, mask=k_mask, other=0.0).to(tl.float32)
                    acc3 += tl.sum(w * x3[None, :], axis=1)
        if ROWS == 1:
            acc = tl.sum(wide, axis=1)
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + cols, (acc + bias).to(dtype), mask=col_mask)
        if ROWS > 1:
            tl.store(out_ptr + stride_o + cols, (acc1 + bias).to(dtype), mask=col_mask)
        if ROWS > 2:
            tl.store(out_ptr + 2 * stride_o + cols, (acc2 + bias).to(dtype), mask=col_mask)
        if ROWS > 3:
            tl.store(out_ptr + 3 * stride_o + cols, (acc3 + bias).to(dtype), mask=col_mask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """``x [M, K] @ weight[N, K].T + bias`` for 1 <= M <= MAX_ROWS, rows of x and weight contiguous."""
    if not HAVE_TRITON:  # pragma: no cover
        raise RuntimeError("gemv needs triton")
    rows, k = x.shape
    n = weight.shape[0]
    if silu_mul:  # x holds [gate | up]; the product's K is half of it
        if rows != 1 or k % 2:
            raise ValueError(f"silu_mul takes one row of [gate | up], got {tuple(x.shape)}")
        k //= 2
    if not 1 <= rows <= MAX_ROWS or weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [1..{MAX_ROWS}, K] and weight [N, K] with contiguous rows, "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    config = config or _CONFIG
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, bias if bias is not None else weight, out, n, k, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=rows, HAS_BIAS=bias is not None, BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.stages,
        SILU_MUL=silu_mul, PREFETCH=config.prefetch if rows == 1 else 0, **pdl(x),
        num_warps=config.warps,
    )
    return out


_CONFIG = GemvConfig()


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` sends this product to the kernel: a few rows of half-precision on a GPU."""
    return (HAVE_TRITON and x.is_cuda and x.dim() == 2 and 1 <= x.shape[0] <= TAKES_ROWS
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and x.stride(1) == 1 and weight.stride(1) == 1 and envs.VLLM_ACTORS_GEMV)


def silu_mul_linear(gate_up: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
    """``module(silu_and_mul(gate_up))``; at one row the GEMV reads SiLU(gate) * up itself (one
    kernel fewer; ``VLLM_ACTORS_GEMV_SILU=0`` turns it off). An FP8 projection has its own."""
    fp8_fused = getattr(module, "silu_mul_forward", None)  # `models/fp8.py` `Fp8Linear`
    if fp8_fused is not None:
        out: torch.Tensor = fp8_fused(gate_up)
        return out
    if gate_up.shape[0] == 1 and takes(gate_up, module.weight) and envs.VLLM_ACTORS_GEMV_SILU:
        return gemv(gate_up, module.weight, module.bias, silu_mul=True)
    from vllm_actors.kernels.fused_ops import silu_and_mul

    return linear(silu_and_mul(gate_up), module)


def linear(x: torch.Tensor, module: torch.nn.Linear) -> torch.Tensor:
    """``module(x)``, through ``gemv`` where it ``takes`` the product."""
    if module.weight.dtype == torch.float8_e4m3fn:  # an FP8 projection (`models/fp8.py`) runs its own GEMM
        return module(x)
    if takes(x, module.weight):
        return gemv(x, module.weight, module.bias)
    return F.linear(x, module.weight, module.bias)
