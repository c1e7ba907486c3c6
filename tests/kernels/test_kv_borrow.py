"""Borrowed KV capacity, the attention math (kernels/kv_borrow.py) in float64: a request whose
blocks are spread over a home and two lenders (each its own cache, its own block ids), prefilled
in chunks and then decoded, each participant storing only its tokens' K/V and attending to its
share; the shares merged by their LSE equal causal attention over the whole context."""

from __future__ import annotations

import torch

from vllm_actors.kernels.kv_borrow import BorrowedTable, merge_shares, share_attention

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
