"""FP8 weight GEMMs: ``x [M, K] @ dequantize(weight)[N, K].T`` with float8_e4m3fn weights and scales.

A weight's scales are indexed as ``scale[n // group_n, k // group_k]``: ``(group_n, group_k)`` is the
block (Qwen3-FP8's ``[128, 128]``), or ``(1, K)`` for a scale per output channel. The activations are
quantized on the fly the same way along K: a float32 scale per token and group of ``group_k``
inputs (``amax / 448``, vLLM's ``per_token_group_quant_fp8``; a group of K is per token), so each
``BLOCK_K`` tile of a product is an FP8 dot product scaled by one activation scale per row and one
weight scale per column, accumulated in float32 (vLLM's ``w8a8_block_fp8_matmul``). A one-row
product (batch-1 decode) goes to a GEMV instead: a program per ``BLOCK_N`` columns reading each
weight byte once, the same tile sums and scales. Up to ``VLLM_ACTORS_FP8_GEMV_ROWS`` rows (1) go to
the weight-only GEMV of ``kernels/fp8_gemv.py`` instead, whose activations are not quantized. Above
them, [128, 128] blocks go to cuBLASLt's block-scaled FP8 GEMM (``torch._scaled_mm``,
``kernels/fp8_scaled_mm.py``) where a probe found it gives the reference's result, else to the
Triton GEMM here, launched with the tiles of ``kernels/fp8_gemm_config.py`` (tuned tables per weight
shape and rows, else a choice by rows).

``fp8_linear_reference`` computes the same in float64 (tests); ``quantize_weight`` and
``dequantize_weight`` convert in torch (the CPU path dequantizes at load; tests quantize with them):
they live in ``kernels/fp8_quant_torch.py`` and are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from vllm_actors.envs import envs
from vllm_actors.kernels import fp8_gemm_config, fp8_scaled_mm
from vllm_actors.kernels.fp8_gemm_config import GemmLaunch
from vllm_actors.kernels.fp8_quant_torch import (  # noqa: F401 - importable from here as before
    AMAX_FLOOR,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_weight,
    fp8_linear_reference,
    quantize_activations_torch,
    quantize_weight,
    weight_groups,
)

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a triton without host tensor descriptors: pointer loads only
    TensorDescriptor = None


# ------------------------------------------------------------------------------------ triton
if HAVE_TRITON:

    @triton.jit
    def _round_e4m3(x):
        """x (float32, within +-448) rounded to the nearest e4m3 value, ties to even, in float32
        arithmetic (adding then subtracting a power of two 2^20 above its e4m3 step): the cast after
        it is exact. Triton's interpreter casts values just below a power of two to half of it."""
        bits = x.to(tl.int32, bitcast=True) & 0x7F800000  # |x|'s power of two (exponent bits only)
        step = tl.maximum(bits.to(tl.float32, bitcast=True), 0.015625)  # e4m3's subnormals share 2^-6's step
        magic = step * 1048576.0
        return tl.where(x < 0, -((-x + magic) - magic), (x + magic) - magic)

    @triton.jit
    def _quant_kernel(x_ptr, q_ptr, s_ptr, M, K, GROUP, stride_x, stride_q, stride_s, stride_sg, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr, ONE_PASS: tl.constexpr):
        """``ROWS`` rows of one group: each row's amax over the group, then x / scale saturated to e4m3."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        group = tl.program_id(1)
        start = group * GROUP
        row_mask = rows < M
        if ONE_PASS:  # the group fits one tile: loaded once
            cols = start + tl.arange(0, BLOCK)
            mask = row_mask[:, None] & ((cols < K) & (tl.arange(0, BLOCK) < GROUP))[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / 448.0
            q = _round_e4m3(tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0))
            tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + rows * stride_s + group * stride_sg, scale, mask=row_mask)
        else:
            amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for off in range(0, GROUP, BLOCK):
                cols = start + off + tl.arange(0, BLOCK)
                mask = row_mask[:, None] & ((cols < K) & (off + tl.arange(0, BLOCK) < GROUP))[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.abs(x))
            scale = tl.maximum(tl.max(amax, axis=1), 1e-10) / 448.0
            for off in range(0, GROUP, BLOCK):
                cols = start + off + tl.arange(0, BLOCK)
                mask = row_mask[:, None] & ((cols < K) & (off + tl.arange(0, BLOCK) < GROUP))[None, :]
                x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                q = _round_e4m3(tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0))
                tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
            tl.store(s_ptr + rows * stride_s + group * stride_sg, scale, mask=row_mask)

    @triton.jit
    def _gemm_kernel(
        a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K, group_n, group_k,
        stride_am, stride_bn, stride_cm, stride_as, stride_bs,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, ONE_B_SCALE: tl.constexpr, TMA: tl.constexpr,
    ):
        """C [M, N] = sum over K tiles of (A_q tile @ B_q tile.T) * a_scale[m, k] * b_scale[n, k].
        ``ONE_B_SCALE``: the tile's columns lie in one weight scale block (BLOCK_N divides group_n), so
        each K step scales the tile's product by one vector (a row's scale times the block's): one FMA
        per element of the accumulator instead of two products and a sum. ``TMA``: ``a_ptr`` and ``b_ptr``
        are tensor descriptors of A [M, K] and B [N, K] (tiles by Hopper's tensor memory accelerator,
        zeros past the edges) instead of pointers."""
        pid = tl.program_id(0)
        tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n  # rows of tiles visited together (L2 reuse of B)
        first_m = (pid // per_group) * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % rows_in_group
        pid_n = (pid % per_group) // rows_in_group
        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        if not TMA:
            offs_k = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
            b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
        as_ptrs = as_ptr + offs_m * stride_as
        if ONE_B_SCALE:
            b_scale_ptr = bs_ptr + (pid_n * BLOCK_N // group_n) * stride_bs
        else:
            bs_ptrs = bs_ptr + (offs_n // group_n) * stride_bs
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if TMA:
                a = a_ptr.load([pid_m * BLOCK_M, k * BLOCK_K])
                b = b_ptr.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                left = K - k * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < left, other=0.0)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            group = k * BLOCK_K // group_k
            a_s = tl.load(as_ptrs + group)
            if ONE_B_SCALE:
                acc += tl.dot(a, b) * (a_s * tl.load(b_scale_ptr + group))[:, None]
            else:
                acc += tl.dot(a, b) * a_s[:, None] * tl.load(bs_ptrs + group)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)[None, :]
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gemv_kernel(
        xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, N, K, group_n, group_k, stride_w, stride_ws,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        """One row: ``BLOCK_N`` columns, each K tile summed in float32 then scaled as the GEMM does."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            k_mask = k < K
            w = tl.load(w_ptr + cols[:, None] * stride_w + k[None, :], mask=col_mask[:, None] & k_mask[None, :],
                        other=0.0, eviction_policy="evict_first").to(tl.float32)
            x = tl.load(xq_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            group = k0 // group_k
            x_s = tl.load(xs_ptr + group)
            w_s = tl.load(ws_ptr + (cols // group_n) * stride_ws + group, mask=col_mask, other=0.0)
            acc += tl.sum(w * x[None, :], axis=1) * x_s * w_s
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


_ROWS = 8  # rows of the activations a quantization program takes (of one group)


@dataclass(frozen=True)
class Fp8GemmConfig:
    """``launch``: the GEMM's tiles for every row count (None: ``fp8_gemm_config.choose_launch``'s, from
    the tuned tables or by rows); the one-row GEMV's columns per program; whether torch._scaled_mm runs."""

    launch: GemmLaunch | None = None
    gemv_columns: int = 16  # the interpreter: 128 (it runs programs one at a time)
    scaled_mm: bool = True  # above the GEMVs' rows, torch._scaled_mm where it probed right (`fp8_scaled_mm.py`)


_CONFIG = Fp8GemmConfig()


def _require_triton() -> None:
    if not HAVE_TRITON:  # pragma: no cover
        raise RuntimeError("the FP8 GEMMs need triton")


def quantize_activations(x: torch.Tensor, group: int, column_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: (float8 x [M, K], float32 scales [M, ceil(K / group)]), one scale per row and group;
    ``column_major``: the scales' strides are (1, M) (cuBLASLt's layout, `kernels/fp8_scaled_mm.py`)."""
    _require_triton()
    rows, k = x.shape
    groups = -(-k // group)
    q = torch.empty((rows, k), dtype=FP8_DTYPE, device=x.device)
    s = (torch.empty((groups, rows), dtype=torch.float32, device=x.device).t() if column_major
         else torch.empty((rows, groups), dtype=torch.float32, device=x.device))
    per_program = _ROWS if x.is_cuda else 32  # the interpreter runs programs one by one: fewer, larger ones
    block = min(triton.next_power_of_2(group), 4096 // per_program)
    _quant_kernel[(triton.cdiv(rows, per_program), groups)](
        x, q, s, rows, k, group, x.stride(0), q.stride(0), s.stride(0), s.stride(1), ROWS=per_program, BLOCK=block,
        ONE_PASS=group <= block, num_warps=4,
    )
    return q, s


def tile_k(group_k: int, k: int) -> int:
    """The K tile of the kernels: it may not straddle two scale groups (so it divides ``group_k``,
    or covers all of K)."""
    if group_k >= k:
        return max(16, min(triton.next_power_of_2(k), 128))
    if group_k & (group_k - 1) or group_k < 16:
        raise ValueError(f"the FP8 GEMM takes scale blocks of a power-of-two width of at least 16, got {group_k}")
    return min(group_k, 128)


def gemv_rows() -> int:
    """Rows up to which ``fp8_linear`` runs the weight-only GEMV (``VLLM_ACTORS_FP8_GEMV_ROWS``, at most 4)."""
    return min(envs.VLLM_ACTORS_FP8_GEMV_ROWS, 4)  # fp8_gemv.MAX_ROWS


@dataclass(frozen=True)
class QuantizedActivations:
    """Activations already quantized for one FP8 projection by a fused producer
    (`kernels/fp8_quant_fused.py`): ``x_q`` float8 and ``x_s`` float32 scales per row and group, in the
    GEMM's layout (``layout``: cuBLASLt's, rows padded by ``fp8_scaled_mm.padded_rows``; None: the
    Triton GEMM's, row-major); ``rows``: the real rows; ``dtype``: the output's."""

    x_q: torch.Tensor
    x_s: torch.Tensor
    rows: int
    dtype: torch.dtype
    layout: fp8_scaled_mm.ScaleLayout | None


@dataclass(frozen=True)
class GemmPlan:
    """How ``fp8_linear`` runs a product: the weight-only GEMV (``gemv``), else the activations quantized
    for cuBLASLt (``layout``) or for the Triton kernels (None), launched with ``launch``."""

    gemv: bool
    layout: fp8_scaled_mm.ScaleLayout | None = None
    launch: GemmLaunch | None = None


def gemm_plan(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
              config: Fp8GemmConfig | None = None) -> GemmPlan:
    """The path of ``fp8_linear(x, weight, ...)``: ``x``'s rows, device and strides decide (its columns
    may be another producer's input: K is the weight's)."""
    config = config or _CONFIG
    rows, k = x.shape[0], weight.shape[1]
    if rows <= gemv_rows() and x.stride(1) == 1:
        from vllm_actors.kernels import fp8_gemv  # it imports this module's helpers

        gemv_config = fp8_gemv.choose_config(rows, weight, weight_scale, block)  # the tuned table's, else default
        if fp8_gemv.takes(weight, weight_scale, block, gemv_config):
            return GemmPlan(gemv=True)
    group_n, group_k = weight_groups(weight.shape, block)
    launch = config.launch or fp8_gemm_config.choose_launch(rows, weight.shape[0], k,
                                                            (group_n, group_k) if block else None,
                                                            _device_name(x.device))
    if rows > 1 and config.scaled_mm and launch.cublas and fp8_scaled_mm.takes(x, weight, block):
        layout = fp8_scaled_mm.layout(x.device, lambda probe_x, column: quantize_activations(probe_x, 128, column))
        if layout is not None:
            return GemmPlan(gemv=False, layout=layout, launch=launch)
    return GemmPlan(gemv=False, layout=None, launch=launch)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
    bias: torch.Tensor | None = None, config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """Triton: ``x [M, K] @ dequantize(weight, weight_scale).T + bias`` in x's dtype, the activations
    quantized per token and group of ``block[1]`` (per token without ``block``); on a GPU, up to
    ``gemv_rows()`` rows through the weight-only GEMV (activations not quantized), above them through
    ``torch._scaled_mm`` where ``fp8_scaled_mm`` takes the product, its probe passed and the launch
    table does not say the Triton GEMM measured faster at these rows (``GemmLaunch.cublas``)."""
    _require_triton()
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or weight.dtype != FP8_DTYPE:
        raise ValueError(f"fp8_linear takes x [M, K] and a float8_e4m3fn weight [N, K], got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)} {weight.dtype}")
    plan = gemm_plan(x, weight, weight_scale, block, config)
    if plan.gemv:
        from vllm_actors.kernels import fp8_gemv

        return fp8_gemv.fp8_gemv(x, weight, weight_scale, block, bias)  # its launch: the tuned table's, else default
    group_k = weight_groups(weight.shape, block)[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    if plan.layout is not None:
        x_q, x_s = quantize_activations(fp8_scaled_mm.pad_rows(x, plan.layout), group_k,
                                        column_major=plan.layout.a_column_major)
    else:
        x_q, x_s = quantize_activations(x, group_k)
    quantized = QuantizedActivations(x_q, x_s, x.shape[0], x.dtype, plan.layout)
    return fp8_linear_quantized(quantized, weight, weight_scale, block, bias, config, plan.launch)


def fp8_linear_quantized(
    x: QuantizedActivations, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
    bias: torch.Tensor | None = None, config: Fp8GemmConfig | None = None, launch: GemmLaunch | None = None,
) -> torch.Tensor:
    """``fp8_linear``'s product of activations already quantized in the layout its plan chose."""
    config = config or _CONFIG
    if x.layout is not None:
        return fp8_scaled_mm.scaled_mm(x.x_q, x.x_s, weight, weight_scale, x.layout, bias, x.dtype)[:x.rows]
    x_q, x_s, rows = x.x_q, x.x_s, x.rows
    n, k = weight.shape
    group_n, group_k = weight_groups(weight.shape, block)
    out = torch.empty((rows, n), dtype=x.dtype, device=x_q.device)
    bias_arg = bias if bias is not None else out
    block_k = tile_k(group_k, k)
    if rows == 1:
        block_n = config.gemv_columns if x_q.is_cuda else 128
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x_q, x_s, weight, weight_scale, bias_arg, out, n, k, group_n, group_k, weight.stride(0),
            weight_scale.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
        return out
    launch = launch or config.launch or fp8_gemm_config.choose_launch(
        rows, n, k, (group_n, group_k) if block else None, _device_name(x_q.device))
    block_k = min(block_k, launch.block_k)  # powers of two: it still divides the scale block
    a_arg: object = x_q
    b_arg: object = weight
    tma = launch.tma and _tma_takes(x_q, weight)
    if tma:
        a_arg = TensorDescriptor.from_tensor(x_q, [launch.block_m, block_k])
        b_arg = TensorDescriptor.from_tensor(weight, [launch.block_n, block_k])
    grid = (triton.cdiv(rows, launch.block_m) * triton.cdiv(n, launch.block_n),)
    _gemm_kernel[grid](
        a_arg, b_arg, out, x_s, weight_scale, bias_arg, rows, n, k, group_n, group_k,
        x_q.stride(0), weight.stride(0), out.stride(0), x_s.stride(0), weight_scale.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=block_k,
        GROUP_M=launch.group_m, ONE_B_SCALE=group_n % launch.block_n == 0, TMA=tma,
        num_warps=launch.warps, num_stages=launch.stages,
    )
    return out


def _tma_takes(x_q: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether tensor descriptors can describe A and B: this triton has them, rows of 16-byte multiples
    on 16-byte aligned bases (else the pointer loads run)."""
    return (TensorDescriptor is not None and all(t.stride(1) == 1 and t.stride(0) % 16 == 0
                                                 and t.data_ptr() % 16 == 0 for t in (x_q, weight)))


@lru_cache(maxsize=16)
def _device_index_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _device_name(device: torch.device) -> str:
    """The name the tuned tables are keyed by (``cpu`` off CUDA: the interpreter takes the defaults)."""
    if device.type != "cuda":
        return device.type
    return _device_index_name(device.index if device.index is not None else torch.cuda.current_device())
