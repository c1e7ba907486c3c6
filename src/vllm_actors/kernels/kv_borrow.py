"""Borrowed KV capacity across replicas, the attention math of one borrowing request: its block table
split over *participants* (participant 0 the home, which runs the model, then the lenders, which
hold KV only), each attending to its share by absolute positions, the shares merged exactly by their
log-sum-exp. No exchange here: what the home would send a lender each layer (the step's queries and
the new K/V of the lender's blocks) and what it gets back (output and LSE) are the arguments and
results of these functions.

The lenders hold the leading blocks of the table, each a contiguous run in lender order, and the
home the rest: a loan is a fixed count reserved at placement, while the home's blocks grow with the
decode (its own pool, as for any request). The torch loop of KV parallelism does the attention
(``kv_parallel.partial_paged_attention``): participant ``p``'s share is handed to it as KV-parallel
rank ``p`` of ``N`` by writing table entry ``j`` as ``block * N + owner(j)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_actors.kernels.attention import build_attention_metadata, write_kv_cache
from vllm_actors.kernels.kv_parallel import partial_paged_attention
from vllm_actors.kernels.kv_parallel_share import merge_partials


@dataclass(frozen=True)
class BorrowedTable:
    """One request's blocks over its ``size`` participants: table block ``j`` is block
    ``blocks[j]`` of participant ``owners[j]``'s own cache."""

    owners: list[int]
    blocks: list[int]
    size: int

    @classmethod
    def lay_out(cls, lent: Sequence[Sequence[int]], home: Sequence[int]) -> BorrowedTable:
        """The table of a request whose lender ``i`` (participant ``i + 1``) lent the blocks
        ``lent[i]`` and whose home holds ``home``: the lenders' first, in order, then the home's."""
        owners = [i + 1 for i, blocks in enumerate(lent) for _ in blocks] + [0] * len(home)
        return cls(owners, [b for blocks in lent for b in blocks] + list(home), len(lent) + 1)

    def encoded(self) -> list[int]:
        """The table as KV-parallel global block ids (``block * size + owner``)."""
        return [block * self.size + owner for owner, block in zip(self.owners, self.blocks, strict=True)]

    def new_slots(self, first: int, count: int, block_size: int, participant: int) -> tuple[list[int], list[int]]:
        """Of the tokens at positions ``first`` .. ``first + count - 1``, those ``participant``
        stores: their indices among the ``count`` and their slots in its cache."""
        indices, slots = [], []
        for index, position in enumerate(range(first, first + count)):
            j = position // block_size
            if self.owners[j] == participant:
                indices.append(index)
                slots.append(self.blocks[j] * block_size + position % block_size)
        return indices, slots


def share_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, table: BorrowedTable, participant: int, seq_len: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One participant's part of a step of the request: stores the new tokens' K/V (``k``, ``v``:
    [T, KV, D], the last T positions before ``seq_len``) that fall in its blocks, then attends the
    queries ``q`` ([T, H, D]) to its share. Returns its output [T, H, D] and LSE [T, H]."""
    block_size = k_cache.shape[1]
    num_tokens = q.shape[0]
    indices, slots = table.new_slots(seq_len - num_tokens, num_tokens, block_size, participant)
    if indices:
        chosen = torch.tensor(indices, dtype=torch.int64, device=q.device)
        write_kv_cache(k.index_select(0, chosen), v.index_select(0, chosen), k_cache, v_cache,
                       torch.tensor(slots, dtype=torch.int64, device=q.device))
    meta = build_attention_metadata([num_tokens], [seq_len], [table.encoded()], block_size, q.device)
    return partial_paged_attention(q, k_cache, v_cache, meta, participant, table.size, scale)


def merge_shares(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The request's attention output from every participant's (output, LSE)."""
    return merge_partials(torch.stack([out for out, _ in parts]), torch.stack([lse for _, lse in parts]))
