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

What the engine runs (``run_attention``): each participant's share is one contiguous run of the
table (a lender's loan, or the home's blocks after the loans), a ``ShareRun`` whose block ids stay
a tensor on the cache's device. The run is handed to the attention as rank 0 of 2 (its blocks as
``block * 2``, every other entry 1), built by torch ops, with no host list as long as the context;
its new tokens are one range of the step's rows, stored by slots worked out the same way. Without
``kernels`` the torch loop attends (the CPU); with them the GPU kernels of KV parallelism
(``kv_parallel_gpu.GpuPartialAttention`` over ``kv_parallel_share.rank_share`` of the run), which
return the same output and LSE. ``share_attention`` over a ``BorrowedTable`` is the general layout,
kept as the reference the tests check runs against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_actors.kernels.attention import AttentionMetadata, build_attention_metadata, write_kv_cache
from vllm_actors.kernels.kv_parallel import partial_paged_attention
from vllm_actors.kernels.kv_parallel_share import merge_partials, rank_share

if TYPE_CHECKING:
    from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention


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


@dataclass(frozen=True)
class ShareRun:
    """A participant's share of one borrowing request as it runs: table blocks ``first`` ..
    ``first + len(blocks) - 1``, its own block ids ``blocks`` ([n] int64, on its cache's device) in
    table order. A lender's run is its loan, which may reach past the context (a loan is reserved
    whole at placement); the home's is the rest of the table."""

    first: int
    blocks: torch.Tensor

    def token_range(self, first_position: int, count: int, block_size: int) -> tuple[int, int]:
        """Of the ``count`` tokens from position ``first_position``, the indices ``[begin, end)``
        of those whose block is in the run (one range: the run is contiguous)."""
        low = self.first * block_size - first_position
        high = (self.first + self.blocks.numel()) * block_size - first_position
        return min(max(low, 0), count), min(max(high, 0), count)

    def slots(self, first_position: int, count: int, block_size: int) -> tuple[int, int, torch.Tensor]:
        """``token_range`` and the slots of those tokens in the participant's cache."""
        begin, end = self.token_range(first_position, count, block_size)
        positions = torch.arange(first_position + begin, first_position + end, device=self.blocks.device)
        blocks = self.blocks.index_select(0, torch.div(positions, block_size, rounding_mode="floor") - self.first)
        return begin, end, blocks * block_size + positions % block_size

    def metadata(self, num_tokens: int, seq_len: int, block_size: int) -> AttentionMetadata:
        """One sequence's metadata (its last ``num_tokens`` of ``seq_len`` positions new) whose table
        holds the run as KV-parallel rank 0 of 2 (entry ``block * 2``) and every other block as
        rank 1's (entry 1); ``slot_mapping``: the new tokens' slots, -1 outside the run."""
        device = self.blocks.device
        width = max(-(-seq_len // block_size), 1)
        low, high = min(self.first, width), min(self.first + self.blocks.numel(), width)
        table = torch.ones(width, dtype=torch.int32, device=device)
        if high > low:
            table[low:high] = (self.blocks[: high - low] * 2).to(torch.int32)
        begin, end, slots = self.slots(seq_len - num_tokens, num_tokens, block_size)
        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        slot_mapping[begin:end] = slots
        # filled on the device: a copy from pageable host memory would wait for the stream (every layer of a
        # guest's step, at the home and at each lender)
        query_start_loc = torch.zeros(2, dtype=torch.int32, device=device)
        query_start_loc[1] = num_tokens
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=torch.full((1,), seq_len, dtype=torch.int32, device=device),
            block_tables=table.unsqueeze(0),
            max_query_len=num_tokens,
            max_seq_len=seq_len,
            query_lens_cpu=[num_tokens],
            seq_lens_cpu=[seq_len],
        )


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, run: ShareRun, seq_len: int, scale: float, store: bool = True,
                  kernels: GpuPartialAttention | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A participant's part of a step of the request, as ``share_attention`` with its share as a
    run: stores the new tokens' K/V that fall in the run (unless ``store`` is False: a fused K/V
    write stored them already), then attends ``q`` to the run, on the GPU ``kernels`` where given
    (else the torch loop). Returns its output [T, H, D] and LSE [T, H] (float32; float64 for
    float64 queries on the torch loop)."""
    block_size = k_cache.shape[1]
    num_tokens = q.shape[0]
    if store:
        begin, end, slots = run.slots(seq_len - num_tokens, num_tokens, block_size)
        if end > begin:
            write_kv_cache(k[begin:end], v[begin:end], k_cache, v_cache, slots)
    meta = run.metadata(num_tokens, seq_len, block_size)
    if kernels is None:
        return partial_paged_attention(q, k_cache, v_cache, meta, 0, 2, scale)
    # size 1: the share's bound of keys (the split count's host hint) is the whole context
    return kernels(q, k_cache, v_cache, meta, rank_share(meta, 0, 2, block_size), 1, scale)
