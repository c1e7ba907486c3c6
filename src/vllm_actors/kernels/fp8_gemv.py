"""Weight-only FP8 GEMV for 1 to 4 rows (W8A16): ``x [M, K] @ dequantize(weight)[N, K].T`` with the
activations kept in their own dtype (bf16 on a GPU) and no activation quantization kernel.

At a few rows the product is a read of the weight; the float8 tile is widened to float32 in
registers and scaled there, free next to its load. The structure and default launch parameters are
the bf16 GEMV's (`kernels/gemv.py`; a tuned table's ``gemv`` entry sets others per weight shape and
rows, ``choose_config``): a program per ``block_n`` columns reading their rows along K in
``block_k`` pieces, a float32 [block_n, block_k] accumulator for one row summed once at the end,
the first weight tiles loaded before the PDL wait, and at one row the down projection reading
SiLU(gate) * up itself. The numerics, in float32 throughout:

- block scales ``[group_n, group_k]`` (Qwen3-FP8's [128, 128]): a program's columns lie in one row
  of scale blocks (``group_n % block_n == 0``), so the scale is a function of k alone and is folded
  into the activations: ``out[m, n] = sum_k w_q[n, k] * (x[m, k] * s[n // group_n, k // group_k])``,
  each K group scaled by its own block's scale; K need not be a multiple of the group. A tile is
  ``[block_n, SPLIT, block_k // SPLIT]``, one K group along its last axis, so a program loads one
  scale per group and multiplies it into that group's activations (a per-element ``k // group_k``
  and scale gather cost more instructions than the float8 tile's own conversion and product);
- a scale per output channel ``[N, 1]`` (compressed-tensors; a per-tensor scale is loaded as one):
  ``out[m, n] = s[n] * sum_k w_q[n, k] * x[m, k]``.

Both equal ``x @ dequantize(weight).T`` up to float32 rounding (``fp8_gemv_reference``, float64).
The W8A8 path of larger batches (`kernels/fp8_gemm.py`) also rounds the activations to e4m3 per
token and group, so a row's result differs slightly between the two paths; each matches its own
reference.
"""

from __future__ import annotations

import torch

from vllm_actors.kernels import fp8_gemm_config
from vllm_actors.kernels.fp8_gemm import FP8_DTYPE, HAVE_TRITON, _device_name, dequantize_weight, weight_groups
from vllm_actors.kernels.fp8_gemv_config import MAX_PREFETCH, MAX_ROWS, Fp8GemvConfig

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from vllm_actors.kernels.gemv import _x_tile
    from vllm_actors.kernels.pdl import pdl, pdl_enter

__all__ = ["MAX_PREFETCH", "MAX_ROWS", "Fp8GemvConfig", "choose_config", "fp8_gemv", "fp8_gemv_reference", "takes"]

_CONFIG = Fp8GemvConfig()


def fp8_gemv_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
    bias: torch.Tensor | None = None, silu_mul: bool = False,
) -> torch.Tensor:
    """float64 ``x @ dequantize(weight).T + bias`` (``silu_mul``: x is [gate | up], its SiLU(gate) *
    up rounded to x's dtype first, as ``silu_and_mul`` rounds it)."""
    if silu_mul:
        gate, up = x.float().chunk(2, dim=-1)
        x = (gate * torch.sigmoid(gate)).to(x.dtype) * up.to(x.dtype)
    out = x.double() @ dequantize_weight(weight, weight_scale, block).double().T
    return out if bias is None else out + bias.double()


def takes(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
          config: Fp8GemvConfig | None = None) -> bool:
    """Whether the GEMV covers this weight's scales: per channel (one scale per row, all of K), or
    blocks whose rows hold whole programs of columns."""
    config = config or _CONFIG
    if weight_scale.dim() != 2:
        return False
    group_n, group_k = weight_groups(weight.shape, block)
    if group_k >= weight.shape[1]:
        return weight_scale.shape[0] == weight.shape[0] or group_n % config.block_n == 0
    return group_n % config.block_n == 0 and group_k >= 16 and not group_k & (group_k - 1)


def choose_config(rows: int, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None
                  ) -> Fp8GemvConfig:
    """The tuned table's launch for this weight's shape and ``rows`` (``fp8_gemm_config.choose_gemv``)
    where the kernel takes the weight's scales with it, else the default ``Fp8GemvConfig()``."""
    n, k = weight.shape
    tuned = fp8_gemm_config.choose_gemv(rows, n, k, (block[0], block[1]) if block else None,
                                        _device_name(weight.device))
    return tuned if tuned is not None and takes(weight, weight_scale, block, tuned) else _CONFIG


if HAVE_TRITON:

    @triton.jit
    def _w_tile3(w_ptr, cols, col_mask, k, k_mask, stride_w):
        """The float8 tile [BLOCK_N, SPLIT, GK] of ``cols`` over ``k`` [SPLIT, GK]."""
        return tl.load(w_ptr + cols[:, None, None] * stride_w + k[None, :, :],
                       mask=col_mask[:, None, None] & k_mask[None, :, :], other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _group_scales(s_row_ptr, k0, K, group_k, SPLIT: tl.constexpr, GK: tl.constexpr):
        """The scales of the SPLIT K groups of the tile at ``k0`` (one per group: no per-element division)."""
        starts = k0 + tl.arange(0, SPLIT) * GK
        return tl.load(s_row_ptr + starts // group_k, mask=starts < K, other=0.0)

    @triton.jit
    def _scaled_x(x_ptr, s_row_ptr, k0, k, k_mask, K, group_k, SILU_MUL: tl.constexpr, BLOCK_SCALES: tl.constexpr,
                  SPLIT: tl.constexpr, GK: tl.constexpr):
        """Row 0 of x over ``k`` [SPLIT, GK] in float32, each K group times its scale where the scales are blocks."""
        x = _x_tile(x_ptr, k, k_mask, K, SILU_MUL)
        if BLOCK_SCALES:
            x = x * _group_scales(s_row_ptr, k0, K, group_k, SPLIT, GK)[:, None]
        return x

    @triton.jit
    def _fp8_gemv_kernel(
        x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, N, K, group_n, group_k, stride_x, stride_w, stride_s, stride_o,
        ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        STAGES: tl.constexpr, PDL: tl.constexpr, SILU_MUL: tl.constexpr, PREFETCH: tl.constexpr,
        BLOCK_SCALES: tl.constexpr,  # scales per [group_n, group_k] block (else one per column)
        SPLIT: tl.constexpr,  # K groups a tile spans: the tile is [BLOCK_N, SPLIT, BLOCK_K // SPLIT]
        TILES: tl.constexpr,  # tiles loaded per loop step (2: one row only)
    ):
        GK: tl.constexpr = BLOCK_K // SPLIT
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        ks = tl.arange(0, SPLIT)[:, None] * GK + tl.arange(0, GK)[None, :]  # a tile's K offsets [SPLIT, GK]
        s_row_ptr = s_ptr + (tl.program_id(0) * BLOCK_N // group_n) * stride_s  # this program's row of blocks
        # no kernel writes the weights: under PDL their first tiles load while the kernel before runs
        # (a tile defined under a constexpr `if` stays defined after it: the branch is inlined)
        if PREFETCH > 0:
            w_a = _w_tile3(w_ptr, cols, col_mask, ks, ks < K, stride_w)
        if PREFETCH > 1:
            w_b = _w_tile3(w_ptr, cols, col_mask, BLOCK_K + ks, BLOCK_K + ks < K, stride_w)
        pdl_enter(PDL)
        wide = tl.zeros([BLOCK_N, SPLIT, GK], dtype=tl.float32)  # one row: summed over K once, at the end
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N], dtype=tl.float32)
        if PREFETCH > 0:
            wide += w_a.to(tl.float32) * _scaled_x(x_ptr, s_row_ptr, 0, ks, ks < K, K, group_k, SILU_MUL,
                                                   BLOCK_SCALES, SPLIT, GK)[None, :, :]
        if PREFETCH > 1:
            wide += w_b.to(tl.float32) * _scaled_x(x_ptr, s_row_ptr, BLOCK_K, BLOCK_K + ks, BLOCK_K + ks < K, K,
                                                   group_k, SILU_MUL, BLOCK_SCALES, SPLIT, GK)[None, :, :]
        for k0 in tl.range(PREFETCH * BLOCK_K, K, TILES * BLOCK_K, num_stages=STAGES):
            k = k0 + ks
            k_mask = k < K
            w = _w_tile3(w_ptr, cols, col_mask, k, k_mask, stride_w).to(tl.float32)
            if TILES > 1:  # one row: a second tile in flight per step, into the same accumulator
                w_next = _w_tile3(w_ptr, cols, col_mask, BLOCK_K + k, BLOCK_K + k < K, stride_w)
            x0 = _scaled_x(x_ptr, s_row_ptr, k0, k, k_mask, K, group_k, SILU_MUL, BLOCK_SCALES, SPLIT, GK)
            if ROWS == 1:
                wide += w * x0[None, :, :]
                if TILES > 1:
                    wide += w_next.to(tl.float32) * _scaled_x(
                        x_ptr, s_row_ptr, k0 + BLOCK_K, BLOCK_K + k, BLOCK_K + k < K, K, group_k, SILU_MUL,
                        BLOCK_SCALES, SPLIT, GK)[None, :, :]
            else:
                scale = tl.full([SPLIT], 1.0, tl.float32)
                if BLOCK_SCALES:
                    scale = _group_scales(s_row_ptr, k0, K, group_k, SPLIT, GK)
                acc += tl.sum(tl.sum(w * x0[None, :, :], axis=2), axis=1)
                x1 = tl.load(x_ptr + stride_x + k, mask=k_mask, other=0.0).to(tl.float32) * scale[:, None]
                acc1 += tl.sum(tl.sum(w * x1[None, :, :], axis=2), axis=1)
                if ROWS > 2:
                    x2 = tl.load(x_ptr + 2 * stride_x + k, mask=k_mask, other=0.0).to(tl.float32) * scale[:, None]
                    acc2 += tl.sum(tl.sum(w * x2[None, :, :], axis=2), axis=1)
                if ROWS > 3:
                    x3 = tl.load(x_ptr + 3 * stride_x + k, mask=k_mask, other=0.0).to(tl.float32) * scale[:, None]
                    acc3 += tl.sum(tl.sum(w * x3[None, :, :], axis=2), axis=1)
        if ROWS == 1:
            acc = tl.sum(tl.sum(wide, axis=2), axis=1)
        col_scale = tl.full([BLOCK_N], 1.0, tl.float32)
        if not BLOCK_SCALES:  # one scale per column, over all of K
            col_scale = tl.load(s_ptr + cols * stride_s, mask=col_mask, other=0.0)
        bias = tl.zeros([BLOCK_N], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        tl.store(out_ptr + cols, (acc * col_scale + bias).to(dtype), mask=col_mask)
        if ROWS > 1:
            tl.store(out_ptr + stride_o + cols, (acc1 * col_scale + bias).to(dtype), mask=col_mask)
        if ROWS > 2:
            tl.store(out_ptr + 2 * stride_o + cols, (acc2 * col_scale + bias).to(dtype), mask=col_mask)
        if ROWS > 3:
            tl.store(out_ptr + 3 * stride_o + cols, (acc3 * col_scale + bias).to(dtype), mask=col_mask)


def _split(k: int, group_k: int, block_scales: bool, config: Fp8GemvConfig) -> int:
    """K groups a tile spans (its third dimension): 1 where one scale covers the tile's K (per channel,
    one group over all of K, or groups wider than the tile)."""
    if not block_scales or group_k >= k or group_k >= config.block_k:
        return 1
    return config.block_k // group_k


def fp8_gemv(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
    bias: torch.Tensor | None = None, config: Fp8GemvConfig | None = None, silu_mul: bool = False,
) -> torch.Tensor:
    """Triton: ``x [M, K] @ dequantize(weight, weight_scale).T + bias`` in x's dtype, 1 <= M <= 4, x
    not quantized (``silu_mul``: one row of [gate | up] of 2K, the product reads SiLU(gate) * up);
    without ``config`` the tuned table's launch for the weight's shape (``choose_config``)."""
    if not HAVE_TRITON:  # pragma: no cover
        raise RuntimeError("the FP8 GEMV needs triton")
    rows, k = x.shape if x.dim() == 2 else (0, 0)
    if silu_mul:
        if rows != 1 or k % 2:
            raise ValueError(f"silu_mul takes one row of [gate | up], got {tuple(x.shape)}")
        k //= 2
    if (not 1 <= rows <= MAX_ROWS or weight.dim() != 2 or weight.shape[1] != k or weight.dtype != FP8_DTYPE
            or x.stride(1) != 1 or weight.stride(1) != 1):
        raise ValueError(f"fp8_gemv takes x [1..{MAX_ROWS}, K] and a float8_e4m3fn weight [N, K] with contiguous "
                         f"rows, got {tuple(x.shape)} and {tuple(weight.shape)} {weight.dtype}")
    config = config or choose_config(rows, weight, weight_scale, block)
    if not takes(weight, weight_scale, block, config):
        raise ValueError(f"fp8_gemv takes a scale per row or blocks of a multiple of {config.block_n} rows and a "
                         f"power-of-two width of at least 16, got block {block} and scales "
                         f"{tuple(weight_scale.shape)}")
    n = weight.shape[0]
    group_n, group_k = weight_groups(weight.shape, block)
    block_scales = not (group_k >= k and weight_scale.shape[0] == n)
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x, weight, weight_scale, bias if bias is not None else out, out, n, k, group_n, group_k, x.stride(0),
        weight.stride(0), weight_scale.stride(0), out.stride(0), ROWS=rows, HAS_BIAS=bias is not None,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, STAGES=config.stages, SILU_MUL=silu_mul,
        PREFETCH=config.prefetch if rows == 1 else 0, BLOCK_SCALES=block_scales,
        SPLIT=_split(k, group_k, block_scales, config), TILES=config.tiles if rows == 1 else 1, **pdl(x),
        num_warps=config.warps,
    )
    return out
