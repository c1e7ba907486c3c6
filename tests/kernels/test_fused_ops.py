"""The fused decoder-layer kernels against their torch references (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels import fused_ops  # conftest.py sets TRITON_INTERPRET=1 without CUDA

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fused_ops.HAVE_TRITON, reason="needs triton")


@pytest.fixture(autouse=True)
def _triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "triton")  # the Triton kernels, also on CPU tensors
    assert fused_ops.use_triton(torch.empty(1, device=DEVICE))  # never a torch-vs-torch comparison


# Triton's interpreter cannot read bfloat16 on the CPU: half precision there, bfloat16 on a GPU.
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16
DTYPES = [torch.float32, HALF]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, with_residual: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn((5, 96), generator=generator).to(dtype).to(DEVICE)
    residual = torch.randn((5, 96), generator=generator).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(96, generator=generator)).to(dtype).to(DEVICE)
    want_out, want_residual = fused_ops.rms_norm_torch(x, weight, 1e-6, residual)
    got_out, got_residual = fused_ops.rms_norm(x, weight, 1e-6, residual)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(got_out, want_out) < tolerance
    assert torch.equal(got_residual, want_residual)


def _launch(monkeypatch: pytest.MonkeyPatch, tiled: bool) -> None:
    """qk_norm_rope's launch: a program per (tile of tokens, head) from one token on, or per (token, head)."""
    from vllm_actors.kernels import qk_rope_tiles

    monkeypatch.setattr(qk_rope_tiles, "TILED_FROM_TOKENS", 1 if tiled else 1 << 30)


@pytest.mark.parametrize("tiled", [False, True], ids=["per-token", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope_in_place_on_views_of_the_fused_projection(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, with_norm: bool, tiled: bool
) -> None:
    _launch(monkeypatch, tiled)
    generator = torch.Generator().manual_seed(1)
    tokens, q_heads, kv_heads, dim = 4, 4, 2, 32
    qkv = torch.randn((tokens, (q_heads + 2 * kv_heads) * dim), generator=generator).to(dtype).to(DEVICE)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    angles = torch.rand((tokens, dim // 2), generator=generator).to(DEVICE) * 6.0
    cos, sin = angles.cos(), angles.sin()
    weights = [(1 + 0.1 * torch.randn(dim, generator=generator)).to(dtype).to(DEVICE) for _ in range(2)]
    q_weight, k_weight = weights if with_norm else (None, None)
    want_q, want_k = fused_ops.qk_norm_rope_torch(q.clone(), k.clone(), cos, sin, q_weight, k_weight, 1e-6)
    v_before = qkv[:, (q_heads + kv_heads) * dim :].clone()
    got_q, got_k = fused_ops.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, 1e-6)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert _rel(got_q, want_q) < tolerance and _rel(got_k, want_k) < tolerance
    assert torch.equal(qkv[:, (q_heads + kv_heads) * dim :], v_before)  # v untouched


@pytest.mark.parametrize("early", [False, True], ids=["late", "early-loads"])
@pytest.mark.parametrize("tiled", [False, True], ids=["per-token", "tiled"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_stores_k_and_v_in_the_cache_in_the_same_launch(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, early: bool, tiled: bool
) -> None:
    """The fused KV write: the rotated k and v land at each token's slot, exactly as the separate
    rope and KV-write kernels put them; a negative slot (a graph's padding row) writes nothing. Also
    with the slots read before the PDL wait (``VLLM_ACTORS_PDL_EARLY_LOADS``)."""
    from vllm_actors.kernels.attention import write_kv_cache

    monkeypatch.setenv("VLLM_ACTORS_PDL_EARLY_LOADS", "1" if early else "0")

    generator = torch.Generator().manual_seed(3)
    tokens, q_heads, kv_heads, dim, block_size, blocks = 5, 4, 2, 32, 4, 6
    qkv = torch.randn((tokens, (q_heads + 2 * kv_heads) * dim), generator=generator).to(dtype).to(DEVICE)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (q_heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    angles = torch.rand((tokens, dim // 2), generator=generator).to(DEVICE) * 6.0
    cos, sin = angles.cos(), angles.sin()
    q_weight, k_weight = [(1 + 0.1 * torch.randn(dim, generator=generator)).to(dtype).to(DEVICE) for _ in range(2)]
    slots = torch.tensor([5, 0, -1, 23, 9], dtype=torch.int64, device=DEVICE)
    shape = (blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=generator).to(dtype).to(DEVICE)
    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    want_q, want_k = fused_ops.qk_norm_rope(q.clone(), k.clone(), cos, sin, q_weight, k_weight, 1e-6)
    keep = slots >= 0
    write_kv_cache(want_k[keep], v[keep], want_k_cache, want_v_cache, slots[keep])

    _launch(monkeypatch, tiled)  # the per-token launch made the reference; the tiled one must match it
    got_q, got_k = fused_ops.qk_norm_rope(q, k, cos, sin, q_weight, k_weight, 1e-6, (v, k_cache, v_cache, slots))
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(k_cache, want_k_cache) and torch.equal(v_cache, want_v_cache)
    with pytest.raises(ValueError, match="caches must be"):
        fused_ops.qk_norm_rope(q, k, cos, sin, None, None, 1e-6, (v, k_cache[:, :, :1], v_cache[:, :, :1], slots))


def test_the_kv_write_is_fused_only_on_the_triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.zeros(1, 2, 32, device=DEVICE)
    assert fused_ops.fuses_kv_write(x)
    monkeypatch.setenv("VLLM_ACTORS_FUSED_KV_WRITE", "0")
    assert not fused_ops.fuses_kv_write(x)
    monkeypatch.setenv("VLLM_ACTORS_FUSED_KV_WRITE", "1")
    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "torch")
    assert not fused_ops.fuses_kv_write(x)
    cos = torch.ones(1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="only on its Triton path"):
        fused_ops.qk_norm_rope(x, x, cos, cos, None, None, 1e-6, (x, x, x, torch.zeros(1, dtype=torch.long)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = torch.randn((3, 2 * 1500), generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    want = fused_ops.silu_and_mul_torch(gate_up)
    got = fused_ops.silu_and_mul(gate_up)
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_shard_embedding_is_the_masked_lookup(dtype: torch.dtype) -> None:
    """A rank's rows of the table in one kernel: the same bits as the torch lookup (ids below, in
    and past the rank's rows; a width that is not a multiple of the kernel's block; one token and
    a batch), and the ids' shape kept."""
    from vllm_actors.kernels.embedding import shard_embedding, shard_embedding_torch

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn((40, 1100), generator=generator).to(dtype).to(DEVICE)  # rows 100..139 of the vocabulary
    for ids in ([99, 100, 139, 140, 120, 0, 5000], [117], [[100, 3], [139, 140]]):
        input_ids = torch.tensor(ids, dtype=torch.long, device=DEVICE)
        want = shard_embedding_torch(input_ids, weight, 100)
        got = shard_embedding(input_ids, weight, 100)
        assert got.shape == (*input_ids.shape, 1100) and torch.equal(got, want)
    assert not shard_embedding(torch.tensor([99, 140], device=DEVICE), weight, 100).any()
