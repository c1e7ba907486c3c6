"""The Triton attention backend: the KV write kernel, ``forward`` (write, then attend), the
backend's choice by ``VLLM_ACTORS_ATTENTION``, and the shapes the kernels refuse."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.support.paged_attention_case import (  # noqa: E402
    DEVICE,
    HAS_CUDA,
    _exact_fp32_matmuls,  # noqa: F401 (autouse: float32 references without TF32)
    assert_close,
    make_case,
    ta,
)
from vllm_actors.kernels.attention import TorchPagedAttention, get_attention_backend, write_kv_cache  # noqa: E402

# ----------------------------------------------------------------------------------------------
# KV write
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 16), (2, 64)])
def test_kv_write_scatters_and_skips_negative_slots(dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads * 1000 + head_dim)
    num_blocks, block_size, tokens = 7, 16, 40
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    # k arrives as a strided view (a slice of a wider projection)
    wide = torch.randn(tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = wide[:, :num_kv_heads]
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1  # padding rows of a CUDA-graph batch
    slots = slots.to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv_cache(k[keep], v[keep], expected_k, expected_v, slots[keep])
    ta.write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


# ----------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_backend_forward_writes_cache_and_attends(kind: str) -> None:
    specs = [(17, 1), (0, 1), (40, 1)] if kind == "decode" else [(17, 1), (0, 12), (40, 3)]
    case = make_case(specs, 16, 6, 3, 32, torch.bfloat16, seed=21)
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv_cache(case.k, case.v, expected_k, expected_v, case.meta.slot_mapping)
    out = ta.TritonPagedAttention().forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.equal(case.k_cache, expected_k) and torch.equal(case.v_cache, expected_v)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, case, torch.bfloat16)


def test_backend_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ACTORS_ATTENTION", raising=False)
    assert isinstance(get_attention_backend(torch.device("cpu")), TorchPagedAttention)
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    assert isinstance(get_attention_backend(torch.device("cpu")), ta.TritonPagedAttention)
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "torch")
    assert isinstance(get_attention_backend(torch.device("cuda")), TorchPagedAttention)
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "flash")
    with pytest.raises(ValueError):
        get_attention_backend(torch.device("cpu"))
    if HAS_CUDA:
        monkeypatch.delenv("VLLM_ACTORS_ATTENTION")
        assert isinstance(get_attention_backend(torch.device("cuda")), ta.TritonPagedAttention)


def test_rejects_bad_shapes() -> None:
    case = make_case([(0, 3)], 16, 4, 2, 32, torch.float32, seed=1)
    m = case.meta
    with pytest.raises(ValueError, match="multiple"):
        ta.paged_attention_varlen(
            case.q[:, :3], case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, 3, 1.0
        )
    with pytest.raises(ValueError, match="cache"):
        ta.paged_attention_varlen(
            case.q.half(), case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, 3, 1.0
        )
    odd = torch.zeros(4, 16, 2, 24, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        ta.paged_attention_decode(
            torch.zeros(1, 4, 24, device=DEVICE), odd, odd, m.query_start_loc, m.seq_lens, m.block_tables, 3, 1.0
        )

