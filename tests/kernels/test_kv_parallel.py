"""KV-parallel attention (kernels/kv_parallel.py) in float64 against plain paged attention over the
whole context: every rank's partial output and log-sum-exp over its own blocks, merged, equal the
reference, for prefills with cached context, chunks and decodes, GQA, a sliding window and a soft
cap; the backend of each rank stores only its own tokens' K/V, into its local blocks."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels.attention import TorchPagedAttention, build_attention_metadata
from vllm_actors.kernels.kv_parallel import (
    KvParallelAttention,
    local_slots,
    merge_partials,
    partial_paged_attention,
)
from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 16  # the Triton kernels' smallest head_dim


def _batch(size: int, seed: int) -> tuple[list[int], list[int], list[list[int]], int]:
    """Three sequences (a prefill over cached context, a chunk, a decode) on shuffled global blocks."""
    generator = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = [9, 5, 1], [23, 5, 31]
    needed = [(n + BLOCK - 1) // BLOCK for n in seq_lens]
    num_blocks = size * (sum(needed) + 3)
    ids = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for count in needed:
        tables.append(ids[used:used + count])
        used += count
    return query_lens, seq_lens, tables, num_blocks


@pytest.mark.parametrize(("size", "window", "cap"), [(2, None, None), (3, 7, None), (2, None, 5.0), (4, 11, 3.0)])
def test_partials_merged_by_lse_equal_attention_over_the_whole_context(size: int, window: int | None,
                                                                      cap: float | None) -> None:
    query_lens, seq_lens, tables, num_blocks = _batch(size, seed=size)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK)
    generator = torch.Generator().manual_seed(1)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=generator, dtype=torch.float64)
    scale = DIM ** -0.5
    want = TorchPagedAttention().forward(q, q[:, :KV_HEADS], q[:, :KV_HEADS], k_cache, v_cache, meta, scale,
                                         kv_written=True, sliding_window=window, logits_soft_cap=cap)
    partials = [partial_paged_attention(q, k_cache[rank::size], v_cache[rank::size], meta, rank, size, scale,
                                        sliding_window=window, logits_soft_cap=cap) for rank in range(size)]
    outputs = torch.stack([out for out, _ in partials])
    lses = torch.stack([lse for _, lse in partials])
    assert outputs.dtype == lses.dtype == torch.float64
    torch.testing.assert_close(merge_partials(outputs, lses), want, rtol=1e-12, atol=1e-12)
    # a rank that holds none of a short sequence's keys reports -inf for it and weighs nothing
    assert torch.isinf(lses).any()


def test_local_slots_keep_only_the_ranks_own_blocks() -> None:
    slots = torch.tensor([0, 5, 9, 14, 23, -1])  # blocks 0, 1, 2, 3, 5 of 4 slots, and a padding row
    assert local_slots(slots, BLOCK, rank=0, size=2).tolist() == [0, -1, 5, -1, -1, -1]
    assert local_slots(slots, BLOCK, rank=1, size=2).tolist() == [-1, 1, -1, 6, 11, -1]


@pytest.mark.parametrize("kernels", [False, True])
def test_each_rank_stores_its_own_tokens_and_the_merged_output_is_exact(kernels: bool) -> None:
    """The backend of every rank, their all-gather played in two passes (each rank's partial first,
    then every rank again with all of them; the second K/V write stores the same values): each
    rank's local cache ends up with its share of the global cache, and each returns the reference
    output; on the torch loop, and on the Triton kernels (interpreted, float32: to its tolerance)."""
    size = 2
    dtype = torch.float32 if kernels else torch.float64
    tolerance = 1e-5 if kernels else 1e-12
    query_lens, seq_lens, tables, num_blocks = _batch(size, seed=7)
    query_lens = list(seq_lens)  # all new: every token's K/V is written this step
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK)
    generator = torch.Generator().manual_seed(2)
    tokens = sum(query_lens)
    q = torch.randn(tokens, HEADS, DIM, generator=generator, dtype=dtype)
    k = torch.randn(tokens, KV_HEADS, DIM, generator=generator, dtype=dtype)
    v = torch.randn(tokens, KV_HEADS, DIM, generator=generator, dtype=dtype)
    shape = (num_blocks, BLOCK, KV_HEADS, DIM)
    k_global, v_global = torch.zeros(shape, dtype=torch.float64), torch.zeros(shape, dtype=torch.float64)
    want = TorchPagedAttention().forward(q.double(), k.double(), v.double(), k_global, v_global, meta, 0.3)

    partials: dict[int, torch.Tensor] = {}
    results: dict[int, torch.Tensor] = {}
    locals_ = {rank: (torch.zeros((num_blocks // size, *shape[1:]), dtype=dtype),
                      torch.zeros((num_blocks // size, *shape[1:]), dtype=dtype)) for rank in range(size)}
    for second in (False, True):
        for rank in range(size):
            def exchange(x: torch.Tensor, rank: int = rank, second: bool = second) -> torch.Tensor:
                partials[rank] = x
                return torch.stack([partials[r] for r in range(size)]) if second else x.expand(size, *x.shape)

            backend = KvParallelAttention(rank, size, BLOCK, exchange, GpuPartialAttention() if kernels else None)
            assert backend.name == ("triton+kv_parallel" if kernels else "torch+kv_parallel")
            results[rank] = backend.forward(q, k, v, *locals_[rank], backend.prepare(meta), 0.3)
    for rank in range(size):
        torch.testing.assert_close(results[rank].double(), want, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(locals_[rank][0].double(), k_global[rank::size], rtol=0, atol=0)
        torch.testing.assert_close(locals_[rank][1].double(), v_global[rank::size], rtol=0, atol=0)


def test_bad_rank_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="KV-parallel rank 2 outside a group of 2"):
        KvParallelAttention(2, 2, BLOCK, lambda x: x)
