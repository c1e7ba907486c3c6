"""A KV-parallel rank's partial attention on the Triton kernels (``kernels/kv_parallel_triton.py``,
under TRITON_INTERPRET=1 here) against the torch reference (``partial_paged_attention``, float64,
itself checked against plain attention in ``test_kv_parallel.py``): output and log-sum-exp of every
rank, for decodes and for prefills with cached context, chunks and decodes mixed, GQA and a soft cap;
on interleaved and shuffled block tables, with a rank that holds none of a sequence's keys (output 0,
LSE -inf); the flash-attn split (the past unmasked, the chunk from there) too, with a stand-in for
flash-attn 4. And the rank's share itself, by hand."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels.attention import AttentionMetadata, build_attention_metadata
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill
from vllm_actors.kernels.kv_parallel import partial_paged_attention
from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention
from vllm_actors.kernels.kv_parallel_share import rank_share
from vllm_actors.kernels.kv_parallel_triton import partial_decode, partial_varlen

BLOCK = 4
HEADS, KV_HEADS, DIM = 4, 2, 16


def _tables(seq_lens: list[int], size: int, interleaved: bool, seed: int) -> tuple[list[list[int]], int]:
    """Block tables: the j-th block on rank j % size (interleaved), or shuffled ids (runs on one rank)."""
    needed = [(n + BLOCK - 1) // BLOCK for n in seq_lens]
    num_blocks = size * (sum(needed) + 2)
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables: list[list[int]] = []
    for count in needed:
        if interleaved:  # each sequence starts on rank 0
            table = []
            for j in range(count):
                table.append(next(b for b in ids if b % size == j % size))
                ids.remove(table[-1])
        else:
            table, ids = ids[:count], ids[count:]
        tables.append(table)
    return tables, num_blocks


def _case(query_lens: list[int], seq_lens: list[int], size: int, interleaved: bool,
          seed: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    tables, num_blocks = _tables(seq_lens, size, interleaved, seed)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK)
    generator = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=generator)
    return meta, q, k_cache, v_cache


def _check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    out, lse = got
    assert out.dtype == lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))  # exactly the rows that see no key of the rank
    torch.testing.assert_close(lse.double(), want[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("size", "interleaved", "cap"), [(2, True, None), (3, False, None), (2, False, 4.0)])
def test_decode_partials_equal_the_reference(size: int, interleaved: bool, cap: float | None) -> None:
    seq_lens = [3, 37, 18, 1]  # one block only: the other ranks hold none of its keys
    meta, q, k_cache, v_cache = _case([1] * len(seq_lens), seq_lens, size, interleaved, seed=size)
    for rank in range(size):
        share = rank_share(meta, rank, size, BLOCK)
        local_k, local_v = k_cache[rank::size].contiguous(), v_cache[rank::size].contiguous()
        got = partial_decode(q, local_k, local_v, meta.query_start_loc, share, max(seq_lens), 0.3,
                             logits_soft_cap=cap, num_splits=4 if rank else None)  # several splits, and the choice
        want = partial_paged_attention(q.double(), local_k.double(), local_v.double(), meta, rank, size, 0.3,
                                       logits_soft_cap=cap)
        _check(got, want)
    assert rank_share(meta, size - 1, size, BLOCK).lens[0] == 0  # the empty share was exercised


@pytest.mark.parametrize(("size", "interleaved", "cap"), [(2, True, None), (3, False, 4.0)])
def test_varlen_partials_equal_the_reference(size: int, interleaved: bool, cap: float | None) -> None:
    """A prefill over cached context (starting mid-block), a whole prompt, a chunk, and a decode."""
    query_lens, seq_lens = [9, 21, 6, 1], [30, 21, 14, 25]
    meta, q, k_cache, v_cache = _case(query_lens, seq_lens, size, interleaved, seed=10 + size)
    for rank in range(size):
        share = rank_share(meta, rank, size, BLOCK)
        local_k, local_v = k_cache[rank::size].contiguous(), v_cache[rank::size].contiguous()
        got = partial_varlen(q, local_k, local_v, meta.query_start_loc, meta.seq_lens, share, max(query_lens), 0.3,
                             logits_soft_cap=cap)
        want = partial_paged_attention(q.double(), local_k.double(), local_v.double(), meta, rank, size, 0.3,
                                       logits_soft_cap=cap)
        _check(got, want)


def _stand_in_flash_attn(**kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn 4's varlen forward, non-causal over ``seqused_k`` paged keys, head-major LSE; a
    sequence without keys gets NaN and +inf, which the caller must not trust."""
    q, k, v = kw["q"], kw["k"], kw["v"]
    starts, used, table = kw["cu_seqlens_q"], kw["seqused_k"], kw["page_table"]
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    assert isinstance(starts, torch.Tensor) and isinstance(used, torch.Tensor) and isinstance(table, torch.Tensor)
    assert kw["causal"] is False and kw["return_lse"] is True
    out = torch.full_like(q, float("nan"))
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
    group = q.shape[1] // k.shape[2]
    for i in range(len(used)):
        rows, count = slice(int(starts[i]), int(starts[i + 1])), int(used[i])
        if count == 0:
            continue
        keys = k[table[i].long()].reshape(-1, k.shape[2], k.shape[3])[:count].repeat_interleave(group, dim=1)
        values = v[table[i].long()].reshape(-1, v.shape[2], v.shape[3])[:count].repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,khd->htk", q[rows], keys) * float(kw["softmax_scale"])  # type: ignore[arg-type]
        lse[:, rows] = torch.logsumexp(scores, dim=-1)
        out[rows] = torch.einsum("htk,khd->thd", torch.softmax(scores, dim=-1), values)
    return out, lse


class _AlwaysFlash(FlashAttnPrefill):
    def wants(self, *args: object, **kwargs: object) -> bool:
        return True


def test_flash_attn_past_and_the_chunk_merge_to_the_reference() -> None:
    size = 2
    query_lens, seq_lens = [9, 21, 6], [30, 21, 14]  # the second has no past on any rank
    meta, q, k_cache, v_cache = _case(query_lens, seq_lens, size, interleaved=True, seed=5)
    kernels = GpuPartialAttention(prefill=_AlwaysFlash("flash_attn", varlen_func=_stand_in_flash_attn))
    for rank in range(size):
        share = rank_share(meta, rank, size, BLOCK)
        local_k, local_v = k_cache[rank::size].contiguous(), v_cache[rank::size].contiguous()
        got = kernels(q, local_k, local_v, meta, share, size, 0.3)
        want = partial_paged_attention(q.double(), local_k.double(), local_v.double(), meta, rank, size, 0.3)
        _check(got, want)


def test_rank_share_by_hand() -> None:
    # 10 keys over blocks [6, 3, 8] (ranks 0, 1, 0 of 2); this step adds the last 3 (positions 7-9)
    meta = build_attention_metadata([3], [10], [[6, 3, 8]], BLOCK)
    zero, one = rank_share(meta, 0, 2, BLOCK), rank_share(meta, 1, 2, BLOCK)
    assert zero.tables.tolist() == [[3, 4, 0]] and one.tables.tolist() == [[1, 0, 0]]  # local ids, in order
    assert zero.lens.tolist() == [6] and one.lens.tolist() == [4]  # 4 + 2 keys of the partial last block
    assert zero.owned_before.tolist() == [[0, 1, 1, 2]] and one.owned_before.tolist() == [[0, 0, 1, 1]]
    assert zero.past.tolist() == [4] and one.past.tolist() == [3]  # keys before position 7: 0-3; 4-6


@pytest.mark.parametrize(("size", "dead"), [(2, 1), (3, 0)])
def test_recovery_layout_partials_equal_the_reference(size: int, dead: int) -> None:
    """The step recomputing a dead rank's share (``actors/worker/lost_share.py``): each run of its
    blocks a sequence of its own on the request's whole table, ending where the run ends; the
    varlen kernel bounds each by true positions as the reference does, on every rank."""
    from vllm_actors.actors.worker.lost_share import HeldRequest, recovery_batch

    seq_len = 43
    (table,), num_blocks = _tables([seq_len], size, interleaved=True, seed=20 + size)
    batch = recovery_batch([HeldRequest(list(range(seq_len)), table, seq_len)], BLOCK, dead, size)
    assert len(batch.query_lens) > 1 and sum(batch.query_lens) < seq_len  # several runs, not the whole
    meta = build_attention_metadata(batch.query_lens, batch.seq_lens, batch.block_tables, BLOCK)
    generator = torch.Generator().manual_seed(size)
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=generator)
    q = torch.randn(sum(batch.query_lens), HEADS, DIM, generator=generator)
    for rank in range(size):
        share = rank_share(meta, rank, size, BLOCK)
        local_k, local_v = k_cache[rank::size].contiguous(), v_cache[rank::size].contiguous()
        got = partial_varlen(q, local_k, local_v, meta.query_start_loc, meta.seq_lens, share,
                             max(batch.query_lens), 0.3)
        _check(got, partial_paged_attention(q.double(), local_k.double(), local_v.double(), meta, rank, size, 0.3))
