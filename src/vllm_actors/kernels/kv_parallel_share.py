"""A KV-parallel rank's share of each sequence's blocks, as the GPU kernels read it.

Block id ``b`` of a (global) block table lives on rank ``b % size`` as local block ``b // size``
(``kernels/kv_parallel.py``). The kernels see a rank's keys as one dense run per sequence: its own
blocks in table order (``tables``, local ids), ``lens`` keys in all (only the sequence's last block
may be partial). A key's true position is not its index in that run, but positions grow with it,
so a causal mask on true positions is one on indices: the query at position ``p`` sees the run's
first ``visible(p)`` keys, ``owned_before[g] * block_size`` of the blocks before its block ``g``
plus ``p % block_size + 1`` of block ``g`` when the rank holds it (``owned_before``: how many of
the first ``g`` blocks the rank holds). Every key before a chunk's first query (``past``) is seen
by all its queries: only the chunk's own keys need the mask.

Built by torch ops on the device from the step's metadata, once a step (the backend's
``prepare``): no host sync, fixed shapes, so a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_actors.kernels.attention import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class RankShare:
    tables: torch.Tensor  # [B, W] int32: local ids of the rank's blocks of each sequence, in order (0-padded)
    lens: torch.Tensor  # [B] int32: keys of the rank's blocks (every one before the sequence's end)
    owned_before: torch.Tensor  # [B, W + 1] int32: of the first g blocks of the sequence, how many the rank holds
    past: torch.Tensor  # [B] int32: keys of the rank before the step's first query of the sequence


def rank_share(meta: AttentionMetadata, rank: int, size: int, block_size: int) -> RankShare:
    """Rank ``rank``'s share (of ``size``) of the sequences of ``meta`` (global block tables)."""
    table = meta.block_tables.long()
    num_seqs, width = table.shape
    seq_lens = meta.seq_lens.long()
    index = torch.arange(width, device=table.device)
    in_use = index.unsqueeze(0) * block_size < seq_lens.unsqueeze(1)  # blocks holding a key of the sequence
    own = in_use & (table % size == rank)
    counts = torch.cumsum(own.long(), dim=1)
    owned_before = torch.cat((torch.zeros((num_seqs, 1), dtype=torch.long, device=table.device), counts), dim=1)
    # compact: the rank's j-th own block goes to column j, the others to a spare column dropped after
    column = torch.where(own, counts - 1, torch.full_like(counts, width))
    tables = torch.zeros((num_seqs, width + 1), dtype=torch.long, device=table.device)
    tables.scatter_(1, column, torch.div(table, size, rounding_mode="floor"))
    keys_in_block = (seq_lens.unsqueeze(1) - index.unsqueeze(0) * block_size).clamp(0, block_size)
    lens = torch.where(own, keys_in_block, 0).sum(dim=1)
    query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
    past = visible_keys(owned_before, seq_lens - query_lens - 1, block_size)
    return RankShare(tables=tables[:, :width].to(torch.int32).contiguous(), lens=lens.to(torch.int32),
                     owned_before=owned_before.to(torch.int32).contiguous(), past=past.to(torch.int32))


def visible_keys(owned_before: torch.Tensor, position: torch.Tensor, block_size: int) -> torch.Tensor:
    """Keys of the rank's run at positions up to ``position`` ([B], -1: none) of each sequence."""
    block = torch.div(position.clamp(min=0), block_size, rounding_mode="floor").unsqueeze(1)
    before = owned_before.long().gather(1, block).squeeze(1)
    held = owned_before.long().gather(1, block + 1).squeeze(1) > before
    count = before * block_size + torch.where(held, position % block_size + 1, 0)
    return torch.where(position >= 0, count, 0)


def merge_partials(outputs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The exact attention from partials over disjoint keys: ``outputs`` [R, T, H, D], ``lses`` [R, T, H]."""
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - torch.where(torch.isinf(total), 0.0, total))  # 0 for a part with no key
    return (weights.unsqueeze(-1) * outputs).sum(dim=0)
