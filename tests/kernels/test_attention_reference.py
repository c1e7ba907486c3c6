"""The torch reference paged attention against a dense float64 computation."""

from __future__ import annotations

import pytest
import torch

from tests.support.paged_batch import shuffled_tables
from vllm_actors.kernels.attention import (
    TorchPagedAttention,
    build_attention_metadata,
    get_attention_backend,
    write_kv_cache,
)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of the last q_len positions over all seq_len keys, with GQA.

    q [q_len, H, D]; k, v [seq_len, Hkv, D].
    """
    q, k, v = q.double(), k.double(), v.double()
    q_len, num_heads, _ = q.shape
    seq_len, num_kv, _ = k.shape
    group = num_heads // num_kv
    out = torch.empty_like(q)
    for h in range(num_heads):
        kh, vh = k[:, h // group], v[:, h // group]
        scores = (q[:, h] @ kh.T) * scale  # [q_len, seq_len]
        for j in range(q_len):
            visible = seq_len - q_len + j + 1
            weights = torch.softmax(scores[j, :visible], dim=-1)
            out[j, h] = weights @ vh[:visible]
    return out


def run_case(
    specs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    seed: int,
) -> None:
    """specs: (cached_len, query_len) per sequence."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables = shuffled_tables(specs, block_size, gen)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # garbage everywhere, so reading a slot that was never written shows up
    k_cache = torch.randn(cache_shape, generator=gen)
    v_cache = torch.randn(cache_shape, generator=gen)
    full_k = [torch.randn(c + q, num_kv_heads, head_dim, generator=gen) for c, q in specs]
    full_v = [torch.randn(c + q, num_kv_heads, head_dim, generator=gen) for c, q in specs]
    qs = [torch.randn(q, num_heads, head_dim, generator=gen) for _, q in specs]

    # the cached prefixes are already in the cache
    prefix = build_attention_metadata([c for c, _ in specs], [c for c, _ in specs], tables, block_size)
    write_kv_cache(
        torch.cat([k[:c] for k, (c, _) in zip(full_k, specs)]),
        torch.cat([v[:c] for v, (c, _) in zip(full_v, specs)]),
        k_cache,
        v_cache,
        prefix.slot_mapping,
    )
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[prefix.slot_mapping] = False

    meta = build_attention_metadata([q for _, q in specs], [c + q for c, q in specs], tables, block_size)
    untouched[meta.slot_mapping] = False
    before_k = k_cache.clone()
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, specs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, specs)])
    scale = head_dim**-0.5
    out = TorchPagedAttention().forward(torch.cat(qs), new_k, new_v, k_cache, v_cache, meta, scale)

    assert out.shape == (sum(q for _, q in specs), num_heads, head_dim)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[meta.slot_mapping], new_k)
    assert torch.equal(flat_v[meta.slot_mapping], new_v)
    assert torch.equal(flat_k[untouched], before_k.view(-1, num_kv_heads, head_dim)[untouched])

    start = 0
    for i, (_, q) in enumerate(specs):
        expected = dense_attention(qs[i], full_k[i], full_v[i], scale)
        got = out[start : start + q].double()
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5, msg=f"sequence {i} {specs[i]}")
        start += q


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("length_kind", ["one", "block", "block_plus_one", "long"])
def test_single_prefill(block_size: int, length_kind: str) -> None:
    length = {"one": 1, "block": block_size, "block_plus_one": block_size + 1, "long": 3 * block_size + 5}[length_kind]
    run_case([(0, length)], block_size, num_heads=4, num_kv_heads=2, head_dim=16, seed=length)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    "cached,new",
    [(7, 5), (16, 17), (15, 1), (16, 1), (17, 1), (33, 16)],
)
def test_cached_prefix_plus_chunk(block_size: int, cached: int, new: int) -> None:
    run_case([(cached, new)], block_size, num_heads=4, num_kv_heads=2, head_dim=16, seed=cached * 100 + new)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_decode_prefill_batch(block_size: int, heads: tuple[int, int]) -> None:
    specs = [
        (0, 1),
        (0, block_size),
        (block_size + 3, 1),
        (5, block_size + 1),
        (2 * block_size, 7),
        (40, 1),
        (0, 2 * block_size + 1),
    ]
    run_case(specs, block_size, num_heads=heads[0], num_kv_heads=heads[1], head_dim=32, seed=block_size + heads[1])


def test_backend_factory_and_head_dim_64() -> None:
    backend = get_attention_backend(torch.device("cpu"))
    assert isinstance(backend, TorchPagedAttention)
    run_case([(3, 9), (20, 1)], 16, num_heads=9, num_kv_heads=3, head_dim=64, seed=7)


def test_metadata_layout() -> None:
    meta = build_attention_metadata([3, 1], [5, 9], [[7, 2], [4, 0, 3]], block_size=4)
    # seq 0 positions 2,3,4 -> blocks 7,7,2; seq 1 position 8 -> block 3 offset 0
    assert meta.slot_mapping.tolist() == [30, 31, 8, 12]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [5, 9]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 3]]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len) == (3, 9)
