"""Borrowed KV capacity, the attention math (kernels/kv_borrow.py) in float64: a request whose
blocks are spread over a home and two lenders (each its own cache, its own block ids), prefilled
in chunks and then decoded, each participant storing only its tokens' K/V and attending to its
share; the shares merged by their LSE equal causal attention over the whole context. The shares as
the engine runs them (``ShareRun``, ``run_attention``) equal those, on the torch loop in float64
and on the GPU kernels (Triton, interpreted here) in float32, a loan reaching past the context and
a share with no key yet included."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels.kv_borrow import BorrowedTable, ShareRun, merge_shares, run_attention, share_attention

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def dense_causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of the last ``len(q)`` positions over ``keys``/``values`` ([S, KV, D]), causal."""
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale  # [H, T, S]
    seq_len, num_tokens = keys.shape[0], q.shape[0]
    q_pos = torch.arange(seq_len - num_tokens, seq_len).unsqueeze(1)
    scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > q_pos, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)


def test_the_shares_of_a_home_and_two_lenders_merge_into_attention_over_the_whole_context() -> None:
    generator = torch.Generator().manual_seed(0)
    # lender 1 lent blocks 5, 2, 7; lender 2 blocks 0, 3; the home holds 6, 1, 4 (its own ids)
    table = BorrowedTable.lay_out([[5, 2, 7], [0, 3]], [6, 1, 4])
    assert table.owners == [1, 1, 1, 2, 2, 0, 0, 0] and table.encoded()[:2] == [5 * 3 + 1, 2 * 3 + 1]
    caches = [(torch.zeros(8, BLOCK, KV_HEADS, DIM, dtype=torch.float64),
               torch.zeros(8, BLOCK, KV_HEADS, DIM, dtype=torch.float64)) for _ in range(3)]
    scale = DIM ** -0.5
    keys = torch.randn(31, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    values = torch.randn(31, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
    seq_len = 0
    for num_tokens in (7, 12, 9, 1, 1, 1):  # chunks crossing the participants' runs, then decodes
        seq_len += num_tokens
        q = torch.randn(num_tokens, HEADS, DIM, generator=generator, dtype=torch.float64)
        k, v = keys[seq_len - num_tokens:seq_len], values[seq_len - num_tokens:seq_len]
        parts = [share_attention(q, k, v, *caches[p], table, p, seq_len, scale) for p in range(3)]
        torch.testing.assert_close(merge_shares(parts), dense_causal(q, keys[:seq_len], values[:seq_len], scale),
                                   rtol=1e-12, atol=1e-12)
    # each participant stored exactly its own tokens: lender 2's blocks 0 and 3 hold positions 12..19
    lender2_k = caches[2][0]
    torch.testing.assert_close(lender2_k[0], keys[12:16])
    torch.testing.assert_close(lender2_k[3], keys[16:20])
    assert table.new_slots(10, 4, BLOCK, 2) == ([2, 3], [0, 1])  # positions 12 and 13: block 0 of lender 2


def _runs(table: BorrowedTable, device: str = "cpu") -> list[ShareRun]:
    """Each participant's share of ``table`` as a run (the home's last: its blocks follow the loans)."""
    runs = []
    for participant in range(table.size):
        indices = [j for j, owner in enumerate(table.owners) if owner == participant]
        blocks = torch.tensor([table.blocks[j] for j in indices], dtype=torch.int64, device=device)
        runs.append(ShareRun(indices[0], blocks))
    return runs


def test_a_run_knows_its_tokens_and_their_slots() -> None:
    run = ShareRun(3, torch.tensor([7, 2]))  # table blocks 3 and 4: positions 12 .. 19 with blocks of 4
    assert run.token_range(10, 4, BLOCK) == (2, 4)  # positions 12, 13
    assert run.token_range(0, 5, BLOCK) == (5, 5) and run.token_range(20, 3, BLOCK) == (0, 0)
    begin, end, slots = run.slots(11, 10, BLOCK)  # positions 11 .. 20: 12 .. 19 are the run's
    assert (begin, end) == (1, 9) and slots.tolist() == [28, 29, 30, 31, 8, 9, 10, 11]
    meta = run.metadata(3, 14, BLOCK)  # positions 11, 12, 13 new: 12 and 13 in block 7
    assert meta.block_tables.tolist() == [[1, 1, 1, 14]] and meta.slot_mapping.tolist() == [-1, 28, 29]


def test_runs_give_the_shares_of_the_table_on_the_torch_loop() -> None:
    generator = torch.Generator().manual_seed(1)
    table = BorrowedTable.lay_out([[5, 2, 7], [0, 3]], [6, 1, 4])
    runs = _runs(table)
    # the second lender's loan reaches past the context it holds for the first chunks
    caches = [[(torch.randn(8, BLOCK, KV_HEADS, DIM, generator=generator, dtype=torch.float64),
                torch.randn(8, BLOCK, KV_HEADS, DIM, generator=generator, dtype=torch.float64)) for _ in range(3)]
              for _ in range(2)]
    caches[1] = [(k.clone(), v.clone()) for k, v in caches[0]]
    scale = DIM ** -0.5
    seq_len = 0
    for num_tokens in (5, 9, 10, 1, 1):
        seq_len += num_tokens
        q = torch.randn(num_tokens, HEADS, DIM, generator=generator, dtype=torch.float64)
        k = torch.randn(num_tokens, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
        v = torch.randn(num_tokens, KV_HEADS, DIM, generator=generator, dtype=torch.float64)
        for p in (1, 2, 0):
            want = share_attention(q, k, v, *caches[0][p], table, p, seq_len, scale)
            got = run_attention(q, k, v, *caches[1][p], runs[p], seq_len, scale)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (k_want, v_want), (k_got, v_got) in zip(caches[0], caches[1], strict=True):
        assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)  # the same slots stored


@pytest.mark.parametrize("store", [True, False])
def test_runs_on_the_gpu_kernels_equal_the_torch_loop(store: bool) -> None:
    """Triton (interpreted) partials of each run, chunks and decodes; ``store`` False: the K/V are
    in the cache already (a fused write), and the run only attends."""
    from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention

    heads, kv_heads, dim = 4, 2, 16  # the kernels' smallest head dim
    generator = torch.Generator().manual_seed(2)
    table = BorrowedTable.lay_out([[5, 2, 7], [0, 3, 6]], [1, 4, 2, 7])
    runs = _runs(table)
    kernels = GpuPartialAttention(decode_splits=2)
    caches = [(torch.randn(8, BLOCK, kv_heads, dim, generator=generator),
               torch.randn(8, BLOCK, kv_heads, dim, generator=generator)) for _ in range(3)]
    scale = dim ** -0.5
    seq_len = 0
    for num_tokens in (6, 11, 1, 9, 1, 1):  # the second lender's blocks: none seen yet at first
        seq_len += num_tokens
        q = torch.randn(num_tokens, heads, dim, generator=generator)
        k = torch.randn(num_tokens, kv_heads, dim, generator=generator)
        v = torch.randn(num_tokens, kv_heads, dim, generator=generator)
        for p in (1, 2, 0):
            if not store:  # as a fused K/V write would have, beforehand
                begin, end, slots = runs[p].slots(seq_len - num_tokens, num_tokens, BLOCK)
                for x, cache in ((k, caches[p][0]), (v, caches[p][1])):
                    cache.view(-1, kv_heads, dim).index_copy_(0, slots, x[begin:end])
            out, lse = run_attention(q, k, v, *caches[p], runs[p], seq_len, scale, store=store, kernels=kernels)
            want_out, want_lse = run_attention(q.double(), k.double(), v.double(), caches[p][0].double(),
                                               caches[p][1].double(), runs[p], seq_len, scale, store=False)
            assert out.dtype == lse.dtype == torch.float32
            assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))  # -inf: no key of the run seen
            torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
            if p == 2 and seq_len <= 12:
                assert torch.isinf(lse).all()  # the second lender holds positions 12 .. 23
