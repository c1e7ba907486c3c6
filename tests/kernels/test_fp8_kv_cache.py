"""An fp8 KV cache in the kernels: the writes (torch, Triton, the fused rotary launch) store the same
bytes, and every reader (torch reference, Triton varlen and decode) matches float64 attention over
the same fp8 values times their scales, so these tests check the dequantisation, not fp8's error.

Without CUDA the Triton kernels run in the interpreter, which reads fp8 exactly but does not round
to fp8 as the hardware does (no carry into the exponent, subnormals flushed): the CPU write tests
store values that need no rounding (fp8 values times a power-of-two scale, and values past the
range, which saturate); the `gpu` tests write any value and run the kernels at real sizes.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.fp8_case import Fp8Case
from tests.support.fp8_case import make_fp8_case as _make_fp8_case
from vllm_actors.kernels import kv_quant
from vllm_actors.kernels import triton_attention as ta  # conftest.py sets TRITON_INTERPRET=1 without CUDA
from vllm_actors.kernels.attention import (
    TorchPagedAttention,
    write_kv_cache,
)
from vllm_actors.kernels.triton_decode import FP8_TILES

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_quant.kv_scale_tensors(DEVICE, k, v)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


def on_grid(shape: tuple[int, ...], scale: float, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random fp8 values (any finite byte, subnormals included) times ``scale``: a power of two, so
    ``x / scale`` is the fp8 value again and its store needs no rounding."""
    values = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype).float()
    return torch.where(torch.isfinite(values), values, torch.zeros_like(values)) * scale


# ----------------------------------------------------------------------------------------------
# Quantisation and the writes
# ----------------------------------------------------------------------------------------------


def test_quantize_saturates_and_round_trips() -> None:
    scale = torch.tensor([0.5])
    x = torch.tensor([1000.0, -1000.0, 1.0, 0.3, -0.0])
    stored = kv_quant.quantize(x, scale, E4M3)
    assert stored.float().tolist() == [448.0, -448.0, 2.0, 0.625, 0.0]  # saturated, not NaN
    assert kv_quant.dequantize(stored, scale).tolist() == [224.0, -224.0, 1.0, 0.3125, 0.0]
    assert kv_quant.quantize(torch.tensor([1e6]), torch.tensor([1.0]), E5M2).float().item() == 57344.0
    assert kv_quant.resolve_kv_cache_dtype("fp8", torch.bfloat16) is E4M3
    assert kv_quant.resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16) is E4M3
    assert kv_quant.resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16) is E5M2
    assert kv_quant.resolve_kv_cache_dtype("auto", torch.float16) is torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        kv_quant.resolve_kv_cache_dtype("int8", torch.float16)


def test_calculate_kv_scales_is_amax_over_vllms_constants() -> None:
    k = torch.tensor([[1.0, -600.0], [3.0, 2.0]])
    v = torch.tensor([[0.5, 25.0]])
    k_scale, v_scale = torch.ones(1), torch.ones(1)
    kv_quant.calculate_kv_scales(k, v, k_scale, v_scale)
    assert k_scale.item() == 3.0 and v_scale.item() == 0.25  # 600 / 200, 25 / 100
    kv_quant.calculate_kv_scales(torch.zeros(2), torch.zeros(2), k_scale, v_scale)
    assert k_scale.item() == 1.0 and v_scale.item() == 1.0  # an all-zero batch keeps 1.0


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_write_stores_the_torch_bytes(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size, heads, head_dim, tokens = 6, 16, 2, 32, 40
    k_scale, v_scale = (2.0**-5, 2.0**-8) if cache_dtype is E4M3 else (1.0, 1.0)
    shape = (num_blocks, block_size, heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(DEVICE)
    k = on_grid((tokens, heads, head_dim), k_scale, cache_dtype, gen)
    v = on_grid((tokens, heads, head_dim), v_scale, cache_dtype, gen)
    k[0, 0, :2] = torch.tensor([1e6, -1e6]) * k_scale  # beyond the range: saturated
    k, v = k.to(dtype).to(DEVICE), v.to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1  # padding rows of a CUDA-graph batch write nothing
    slots = slots.to(DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv_cache(k[keep], v[keep], want_k, want_v, slots[keep], *scales(k_scale, v_scale))
    ta.write_kv_cache_triton(k, v, k_cache, v_cache, slots, *scales(k_scale, v_scale))
    assert same_bytes(k_cache, want_k) and same_bytes(v_cache, want_v)
    assert want_k.float().abs().max().item() == kv_quant.fp8_max(cache_dtype)


@pytest.mark.parametrize("tiled", [False, True], ids=["per-token", "tiled"])
def test_fused_rotary_write_stores_the_torch_bytes(monkeypatch: pytest.MonkeyPatch, tiled: bool) -> None:
    """The rotary launch that also writes the cache quantises as the torch write, in both launch forms
    (a program per token, for decode; per tile of tokens, for prefill chunks)."""
    from vllm_actors.kernels import fused_ops, qk_rope_tiles

    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "triton")
    monkeypatch.setattr(qk_rope_tiles, "TILED_FROM_TOKENS", 1 if tiled else 1 << 30)
    gen = torch.Generator().manual_seed(5)
    tokens, q_heads, kv_heads, head_dim, block_size, num_blocks = 9, 4, 2, 32, 16, 4
    k_scale, v_scale = 2.0**-4, 2.0**-6
    q = torch.randn(tokens, q_heads, head_dim, generator=gen)
    k = on_grid((tokens, kv_heads, head_dim), k_scale, E4M3, gen)
    v = on_grid((tokens, kv_heads, head_dim), v_scale, E4M3, gen)
    # position 0's rotation (cos 1, sin 0) keeps k on the grid; rotary itself is tested elsewhere
    cos, sin = torch.ones(tokens, head_dim // 2), torch.zeros(tokens, head_dim // 2)
    _, rotated_k = fused_ops.qk_norm_rope_torch(q, k, cos, sin, None, None, 1e-6)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=E4M3), torch.zeros(shape, dtype=E4M3)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    kv_scales = kv_quant.kv_scale_tensors(torch.device("cpu"), k_scale, v_scale)
    write_kv_cache(rotated_k, v, want_k, want_v, slots, *kv_scales)
    fused_ops.qk_norm_rope(q.clone(), k.clone(), cos, sin, None, None, 1e-6, (v, k_cache, v_cache, slots), kv_scales)
    assert same_bytes(k_cache, want_k) and same_bytes(v_cache, want_v)


def test_an_fp8_cache_needs_its_scales() -> None:
    cache = torch.zeros(2, 16, 1, 16, dtype=E4M3, device=DEVICE)
    k = torch.zeros(1, 1, 16, device=DEVICE)
    slots = torch.zeros(1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="needs its layer's k_scale and v_scale"):
        write_kv_cache(k, k, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="needs its layer's k_scale and v_scale"):
        ta.write_kv_cache_triton(k, k, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="float32 tensors of one element"):
        write_kv_cache(k, k, cache, cache.clone(), slots, torch.ones(2, device=DEVICE), torch.ones(1, device=DEVICE))


# ----------------------------------------------------------------------------------------------
# The readers against float64 attention over the stored values
# ----------------------------------------------------------------------------------------------


def make_fp8_case(*args: Any, **kwargs: Any) -> Fp8Case:
    """``tests/support/fp8_case.py``'s case on this module's device."""
    return _make_fp8_case(*args, device=DEVICE, **kwargs)


def assert_close(out: torch.Tensor, case: Fp8Case, dtype: torch.dtype) -> None:
    got, ref = out.double().cpu(), case.expected
    assert torch.isfinite(got).all()
    start = 0
    for i, q_len in enumerate(case.meta.query_lens_cpu):
        part, want = got[start : start + q_len], ref[start : start + q_len]
        rel = ((part - want).norm() / want.norm()).item()
        assert rel < TOLERANCE[dtype], f"sequence {i}: rel err {rel:.2e}"
        start += q_len


def run_varlen(case: Fp8Case) -> torch.Tensor:
    m = case.meta
    return ta.paged_attention_varlen(
        case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, m.max_query_len,
        case.scale, k_scale=case.k_scale, v_scale=case.v_scale,
    )  # fmt: skip


def run_decode(
    case: Fp8Case, num_splits: int | None, fp8_tiles: str | None = None, config: ta.TileConfig | None = None
) -> torch.Tensor:
    m = case.meta
    return ta.paged_attention_decode(
        case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, m.max_seq_len,
        case.scale, num_splits=num_splits, k_scale=case.k_scale, v_scale=case.v_scale, fp8_tiles=fp8_tiles,
        config=config,
    )  # fmt: skip


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_torch_reference_reads_fp8_in_float32(cache_dtype: torch.dtype) -> None:
    case = make_fp8_case([(20, 5), (0, 9), (33, 1)], 16, (4, 2), 32, torch.float32, cache_dtype, seed=1)
    out = TorchPagedAttention().forward(
        case.q, case.q[:, :2], case.q[:, :2], case.k_cache, case.v_cache, case.meta, case.scale, kv_written=True,
        k_scale=case.k_scale, v_scale=case.v_scale,
    )  # fmt: skip
    assert out.dtype == torch.float32
    assert_close(out, case, torch.float32)


@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_varlen_reads_fp8(cache_dtype: torch.dtype) -> None:
    """A cached prefix plus a chunk, a prefill and a decode row in one step; GQA 3 (padded to 4)."""
    case = make_fp8_case([(37, 12), (0, 20), (16, 1)], 16, (6, 2), 32, torch.float32, cache_dtype, seed=2)
    assert_close(run_varlen(case), case, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_reads_fp8(num_splits: int) -> None:
    case = make_fp8_case([(40, 1), (0, 1), (300, 1)], 16, (4, 2), 32, torch.float32, E4M3, seed=3)
    assert_close(run_decode(case, num_splits), case, torch.float32)


@pytest.mark.parametrize("cache_dtype,fp8_tiles", [(E4M3, "query"), (E4M3, "float16"), (E5M2, "float16")])
def test_decode_fp8_tiles_with_bf16_queries(cache_dtype: torch.dtype, fp8_tiles: str) -> None:
    """Each way of meeting bf16 queries (fp16 tiles: q scaled and cast once, only the last tile
    masked): sequences ending inside a tile, on a tile's end, and empty, split in 3."""
    specs = [(40, 1), (255, 1), (300, 1), (0, 1)]
    case = make_fp8_case(specs, 16, (4, 2), 32, torch.bfloat16, cache_dtype, seed=11, kv_scales=(0.05, 0.3))
    out = run_decode(case, 3, fp8_tiles, ta.TileConfig(block_m=16, block_n=32, num_warps=4, num_stages=2))
    assert_close(out, case, torch.bfloat16)


def test_decode_fp16_tiles_saturate_the_query() -> None:
    """A query past fp16's range once scaled is saturated, not infinite (no NaN scores)."""
    case = make_fp8_case([(20, 1)], 16, (4, 2), 32, torch.bfloat16, E4M3, seed=12, kv_scales=(1.0, 1.0))
    case.q[0, 0, :4] = 1e9
    assert torch.isfinite(run_decode(case, 1, "float16")).all()
    with pytest.raises(ValueError, match="fp8_tiles must be one of"):
        run_decode(case, 1, "bfloat16")


def test_backend_writes_and_reads_fp8() -> None:
    """The backend's forward: the Triton write then decode, the same as the torch backend's."""
    case = make_fp8_case([(17, 1), (40, 1)], 16, (4, 2), 32, torch.float32, E4M3, seed=4, kv_scales=(2**-5, 2**-6))
    gen = torch.Generator().manual_seed(4)
    k = on_grid((2, 2, 32), 2**-5, E4M3, gen).to(DEVICE)
    v = on_grid((2, 2, 32), 2**-6, E4M3, gen).to(DEVICE)
    caches = case.k_cache.clone(), case.v_cache.clone()
    out = ta.TritonPagedAttention().forward(
        case.q, k, v, *caches, case.meta, case.scale, k_scale=case.k_scale, v_scale=case.v_scale
    )
    want = TorchPagedAttention().forward(
        case.q, k, v, case.k_cache, case.v_cache, case.meta, case.scale, k_scale=case.k_scale, v_scale=case.v_scale
    )
    assert same_bytes(caches[0], case.k_cache) and same_bytes(caches[1], case.v_cache)
    assert torch.allclose(out, want, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# GPU: real shapes, any value written
# ----------------------------------------------------------------------------------------------


@gpu
@needs_cuda
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_gpu_write_bytes_any_value(cache_dtype: torch.dtype) -> None:
    """Subnormals and saturation included, the Triton write stores torch's bytes."""
    gen = torch.Generator().manual_seed(7)
    tokens, heads, head_dim = 4096, 8, 128
    k = (torch.randn(tokens, heads, head_dim, generator=gen) * torch.logspace(-6, 3, head_dim)).bfloat16().cuda()
    v = (torch.randn(tokens, heads, head_dim, generator=gen) * torch.logspace(-6, 2, head_dim)).bfloat16().cuda()
    shape = (tokens // 16 + 4, 16, heads, head_dim)
    caches = [torch.zeros(shape, dtype=cache_dtype, device="cuda") for _ in range(4)]
    slots = torch.randperm(shape[0] * 16, generator=gen)[:tokens].cuda()
    kv_scales = scales(0.07, 0.003) if cache_dtype is E4M3 else scales(1.0, 1.0)
    write_kv_cache(k, v, caches[0], caches[1], slots, *kv_scales)
    ta.write_kv_cache_triton(k, v, caches[2], caches[3], slots, *kv_scales)
    assert same_bytes(caches[2], caches[0]) and same_bytes(caches[3], caches[1])


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim,heads", [(64, (32, 8)), (128, (32, 8)), (128, (16, 8))])
@pytest.mark.parametrize("cache_dtype", [E4M3, E5M2])
def test_gpu_varlen_fp8_long_prefix(head_dim: int, heads: tuple[int, int], cache_dtype: torch.dtype) -> None:
    """bf16 queries over fp8 caches: a 256-token chunk after a 6k cached prefix, and a 1k prefill
    (the float64 reference on the host bounds the sizes)."""
    case = make_fp8_case([(6000, 256), (0, 1000)], 16, heads, head_dim, torch.bfloat16, cache_dtype, seed=8)
    assert_close(run_varlen(case), case, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim,heads", [(64, (32, 8)), (128, (32, 8))])
@pytest.mark.parametrize("num_splits", [None, 1])
@pytest.mark.parametrize("fp8_tiles", FP8_TILES)
def test_gpu_decode_fp8_long_context(
    head_dim: int, heads: tuple[int, int], num_splits: int | None, fp8_tiles: str
) -> None:
    """bf16 decode over fp8 caches at 32k (split over the context) next to short sequences."""
    case = make_fp8_case([(32767, 1), (100, 1), (5000, 1)], 16, heads, head_dim, torch.bfloat16, E4M3, seed=9)
    assert_close(run_decode(case, num_splits, fp8_tiles), case, torch.bfloat16)


@gpu
@needs_cuda
@pytest.mark.parametrize("head_dim,max_registers", [(64, 128), (128, 168), (128, 128)])
def test_gpu_decode_fp8_under_a_register_cap(head_dim: int, max_registers: int) -> None:
    """A cap on the decode kernel's registers (spilling where it must) leaves its output as it was."""
    case = make_fp8_case([(32767, 1), (100, 1)], 16, (32, 8), head_dim, torch.bfloat16, E4M3, seed=10)
    cfg = ta.TileConfig(block_m=16, block_n=128, num_warps=4, num_stages=2, max_registers=max_registers)
    assert_close(run_decode(case, 8, "float16", cfg), case, torch.bfloat16)
