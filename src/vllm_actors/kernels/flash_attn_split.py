"""A short chunk over a long context on flash-attn 4, split over its keys (flash-decoding for a chunk).

flash-attn 4's SM90 forward has no split-KV: a step's work is one tile of query rows (GQA-packed) per
KV head, so a 256-token chunk of a 1M-token prompt is 8 tiles x 8 KV heads = 64 CTAs on 132 SMs, each
walking every key before it: half the GPU idles for the longest part of the step. Here the chunk's
cached keys before its last partial block are cut into ``num_splits`` ranges of whole blocks and
attended in one more call, non-causal, with the chunk's queries repeated once per range (their own
sequences of the varlen batch, each over its range of the block table); the step's own call keeps
the rest (the last partial block and the chunk itself, causal, and every other sequence) with the
chunk's sequence shifted to start at that block. The partial outputs merge exactly by their
log-sum-exp. Pure host planning from the step's host lists (``plan_key_splits``); the device
tensors are built once per step (``KeySplitTensors``) from host integers, without a sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vllm_actors.kernels.choice import use_triton
from vllm_actors.kernels.kv_parallel_share import merge_partials
from vllm_actors.kernels.split_merge import HAVE_TRITON, merge_split_rows

# keys per range at least: below it a range's fixed cost (its tile's first and last key blocks) weighs
MIN_SPLIT_KEYS = 4096
# the split call's tiles fill the SMs about this many times over (waves)
SPLIT_WAVES = 2
MAX_SPLITS = 64
TILE_M = 128  # flash-attn 4's query tile on SM90 at head_dim 64 and 128 (GQA-packed rows)


@dataclass(frozen=True, slots=True)
class KeySplits:
    """The step's query over the longest context split over its cached keys: sequence ``seq`` (its rows
    ``[q_start, q_start + q_len)``), ranges of ``blocks_per_split`` blocks over blocks
    ``[0, tail_block)`` (the last range may be shorter); the step's own call attends it from block
    ``tail_block`` on."""

    seq: int
    q_start: int
    q_len: int
    seq_len: int
    tail_block: int
    blocks_per_split: int
    num_splits: int


def split_query(query_lens: list[int], seq_lens: list[int]) -> int | None:
    """The query (of 2 tokens or more) with the most keys cached before it: the one whose tiles walk the
    longest, whatever the step's longest query is (a 2,048-token short prompt beside a 68-token chunk of
    a 1M-token prompt left the chunk unsplit: 8 CTAs over 660k keys, 150-200 ms steps on the H200)."""
    best, most = None, -1
    for seq, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if q_len >= 2 and seq_len - q_len > most:
            best, most = seq, seq_len - q_len
    return best


def plan_key_splits(
    query_lens: list[int], seq_lens: list[int], block_size: int, num_heads: int, num_kv_heads: int, num_sms: int,
) -> KeySplits | None:  # fmt: skip
    """Where the step's query over the longest context (``split_query``) leaves SMs idle, its key ranges;
    else None."""
    seq = split_query(query_lens, seq_lens)
    if seq is None:
        return None
    q_len = query_lens[seq]
    context = seq_lens[seq] - q_len
    tiles = math.ceil(q_len * (num_heads // num_kv_heads) / TILE_M) * num_kv_heads
    tail_block = context // block_size
    if tiles >= SPLIT_WAVES * num_sms or tail_block * block_size < 2 * MIN_SPLIT_KEYS:
        return None
    wanted = min(math.ceil(SPLIT_WAVES * num_sms / tiles), tail_block * block_size // MIN_SPLIT_KEYS, MAX_SPLITS)
    if wanted < 2:
        return None
    per = math.ceil(tail_block / wanted)
    return KeySplits(seq=seq, q_start=sum(query_lens[:seq]), q_len=q_len, seq_len=seq_lens[seq],
                     tail_block=tail_block, blocks_per_split=per, num_splits=math.ceil(tail_block / per))


@dataclass(frozen=True, slots=True)
class KeySplitTensors:
    """One step's device arguments of both calls (built once, every layer reads them)."""

    tail_page_table: torch.Tensor  # [B, W] int32: the step's tables, the split sequence's shifted by tail_block
    tail_seqused: torch.Tensor  # [B] int32
    split_page_table: torch.Tensor  # [S, blocks_per_split] int32: each range's blocks
    split_seqused: torch.Tensor  # [S] int32
    split_cu_seqlens: torch.Tensor  # [S + 1] int32: the repeated queries, q_len each


def split_tensors(splits: KeySplits, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  block_size: int) -> KeySplitTensors:
    """The device tensors of ``splits`` from the step's block tables and context lengths (no sync:
    every index and length comes from host integers)."""
    device = block_tables.device
    tables = block_tables.to(torch.int32)
    row, tb, per, count = splits.seq, splits.tail_block, splits.blocks_per_split, splits.num_splits
    width = tables.shape[1]
    tail_table = tables.clone()
    tail_table[row, : width - tb] = tables[row, tb:]
    tail_seqused = seq_lens.to(torch.int32).clone()
    tail_seqused[row] = splits.seq_len - tb * block_size
    index = torch.arange(count, device=device).unsqueeze(1) * per + torch.arange(per, device=device).unsqueeze(0)
    split_table = tables[row][index.clamp(max=tb - 1)].contiguous()  # past a short last range: repeats, unread
    split_seqused = torch.full((count,), per * block_size, dtype=torch.int32, device=device)
    split_seqused[count - 1] = (tb - (count - 1) * per) * block_size
    cu = torch.arange(count + 1, dtype=torch.int32, device=device) * splits.q_len
    return KeySplitTensors(tail_table.contiguous(), tail_seqused, split_table, split_seqused, cu)


def merge_into(out: torch.Tensor, lse: torch.Tensor, splits: KeySplits, split_out: torch.Tensor,
               split_lse: torch.Tensor) -> torch.Tensor:
    """``out`` [T, H, D] with the split sequence's rows merged from the step call's (``lse`` [H, T])
    and the ranges' (``split_out`` [S * q_len, H, D], ``split_lse`` [H, S * q_len]), in float32: one
    Triton launch on a GPU (``split_merge``), the torch form elsewhere (``VLLM_ACTORS_ATTENTION``'s
    choice, ``choice.use_triton``)."""
    if use_triton("VLLM_ACTORS_ATTENTION", HAVE_TRITON, out.device):
        return merge_split_rows(out, lse, splits.q_start, splits.q_len, splits.num_splits, split_out, split_lse)
    return merge_into_torch(out, lse, splits, split_out, split_lse)


def merge_into_torch(out: torch.Tensor, lse: torch.Tensor, splits: KeySplits, split_out: torch.Tensor,
                     split_lse: torch.Tensor) -> torch.Tensor:
    """``merge_into`` in torch ops (``merge_partials``): the reference of the Triton merge."""
    rows = slice(splits.q_start, splits.q_start + splits.q_len)
    num_heads, head_dim = out.shape[1], out.shape[2]
    outputs = torch.cat([out[rows].unsqueeze(0), split_out.view(splits.num_splits, splits.q_len, num_heads, head_dim)])
    lses = torch.cat([lse[:, rows].unsqueeze(0), split_lse.view(num_heads, splits.num_splits, splits.q_len)
                      .transpose(0, 1)]).transpose(1, 2)  # [S + 1, q_len, H]
    out[rows] = merge_partials(outputs.float(), lses).to(out.dtype)
    return out
