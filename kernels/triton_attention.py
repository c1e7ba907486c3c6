"""Triton kernels for paged attention, and `TritonPagedAttention`, the backend built on them.

Same contract as `vllm_actors.kernels.attention`: per layer, `k_cache` and `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; a step's new tokens of B sequences are
flattened to T rows; each sequence's new queries are the last `query_len` positions of its
`seq_len` context and attend causally to all of it, read through its block table.

Kernels:

* `write_kv_cache_triton` scatters the new tokens' k and v into the caches at `slot_mapping`;
  a negative slot is skipped (the padding rows of a CUDA-graph batch).
* `paged_attention_varlen`: flash-attention style (online softmax, fp32 accumulators) over tiles
  of queries x keys. One program takes BLOCK_Q query positions of one sequence for ALL the query
  heads of one KV head (rows = positions x group heads, the group padded to a power of two), so a
  K/V tile is loaded once per KV head. Programs map to sequences without any host work: sequence
  i owns programs [qsl[i] // BLOCK_Q + i, qsl[i+1] // BLOCK_Q + i + 1) — at least the
  ceil(query_len / BLOCK_Q) it needs, at most one spare — found by a binary search in the kernel,
  so the grid is `T // BLOCK_Q + B` programs per KV head.
* `paged_attention_decode` (query_len <= 1 everywhere): one program per (sequence, KV head,
  split); all query heads of the KV head together (rows padded to 16 for the tensor cores), the
  context cut into NUM_SPLITS contiguous ranges of key tiles (flash-decoding). With more than one
  split each program writes its partial (max, sum, normalized output) and a reduce kernel merges
  them. The split count comes from host integers only (batch, heads, `meta.max_seq_len`, SM count),
  and each program derives its key range from the sequence's actual length on the device, so a
  captured CUDA graph stays correct for any length up to the one it was captured with (and beyond:
  only the work per split grows).

No kernel launch here syncs with the host or sizes anything from tensor values: the decode path
can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import structlog
import torch
import triton
import triton.language as tl

from vllm_actors.kernels.attention import AttentionMetadata

log = structlog.get_logger(__name__)

# Triton picks interpreter or compiler when a kernel is decorated, i.e. when this module is imported.
# The interpreter's tl.dot mishandles bfloat16 (it multiplies the raw uint16 bits), so under it
# the operands are widened to float32 first; products of bf16/fp16 values are exact in float32,
# so the result matches the GPU's fp32-accumulating tensor-core dot.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

_LOG2E = 1.4426950408889634
_MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows
_MAX_SPLITS = 64
_MIN_KEYS_PER_SPLIT = 128


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """acc + a @ b in float32; IEEE keeps float32 inputs out of TF32."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


# ----------------------------------------------------------------------------------------------
# KV write
# ----------------------------------------------------------------------------------------------


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM)
    mask = heads[:, None] < tl.where(slot >= 0, num_kv_heads, 0)  # a negative slot writes nothing
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v ([T, num_kv_heads, head_dim]) at the flat cache slots of slot_mapping ([T] int64);
    rows whose slot is negative are skipped."""
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _check_cache_pair(k_cache, v_cache)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    _check_head_dim(head_dim)
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _kv_write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        num_warps=1 if head_dim * num_kv_heads <= 512 else 4,
    )


# ----------------------------------------------------------------------------------------------
# Prefill / mixed batches: varlen attention with a cached prefix
# ----------------------------------------------------------------------------------------------


@triton.jit
def _attend_tile(
    q,
    acc,
    m_i,
    l_i,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    kv_head_offset,
    key_start,
    seq_len,
    q_pos,
    qk_scale,
    stride_cb,
    stride_cs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One online-softmax step over keys [key_start, key_start + BLOCK_N) of one sequence.

    q [BLOCK_M, D]; acc [BLOCK_M, D], m_i, l_i [BLOCK_M] in float32 (m_i in the log2 domain).
    MASKED drops keys at or past seq_len; CAUSAL (with MASKED) also keys past each row's absolute
    position q_pos [BLOCK_M].
    """
    keys = key_start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    if MASKED:
        key_ok = keys < seq_len
        block = tl.load(table_row_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block = tl.load(table_row_ptr + keys // BLOCK_SIZE)
    key_offset = block.to(tl.int64) * stride_cb + (keys % BLOCK_SIZE) * stride_cs + kv_head_offset
    if MASKED:
        k_t = tl.load(k_cache_ptr + key_offset[None, :] + dims[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + key_offset[:, None] + dims[None, :], mask=key_ok[:, None], other=0.0)
    else:
        k_t = tl.load(k_cache_ptr + key_offset[None, :] + dims[:, None])
        v = tl.load(v_cache_ptr + key_offset[:, None] + dims[None, :])
    scores = _dot(q, k_t, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE, INTERP) * qk_scale
    if MASKED:
        if CAUSAL:
            visible = key_ok[None, :] & (keys[None, :] <= q_pos[:, None])
        else:
            visible = key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], IEEE, INTERP)
    return acc, m_new, l_i


# Integer arguments that change with the batch (sequence count, block-table width, splits) are
# not specialised: Triton would otherwise compile a new variant, mid-serving, the first time such
# a value is 1 or a multiple of 16 (the likely cause of a 1.26 s stall in a benchmark on the H100).
@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _varlen_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # sequence of this tile: the last i with qsl[i] // BLOCK_Q + i <= tile
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid + 1, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    seq = lo - 1
    seq_q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - seq_q_start
    local_tile = tile - (seq_q_start // BLOCK_Q + seq)
    first_query = local_tile * BLOCK_Q
    if first_query >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query_index = first_query + rows // GROUP_PAD
    group_index = rows % GROUP_PAD
    row_ok = (query_index < query_len) & (group_index < GROUP)
    head = kv_head * GROUP + group_index
    dims = tl.arange(0, HEAD_DIM)
    token = (seq_q_start + query_index).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    q_pos = prefix_len + query_index

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # mypy sees the binary search's int start, not the tensor it becomes under the JIT
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt  # type: ignore[attr-defined]
    kv_head_offset = kv_head.to(tl.int64) * stride_ch
    # keys below the tile's first position are visible to every row: whole tiles of them need no mask
    first_pos = prefix_len + first_query
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    keys_end = tl.minimum(seq_len, prefix_len + first_query + BLOCK_Q)
    for key_start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, key_start,
            seq_len, q_pos, qk_scale, stride_cb, stride_cs,
            BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, False, IEEE, INTERP,
        )  # fmt: skip
    for key_start in range(unmasked_end, keys_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, key_start,
            seq_len, q_pos, qk_scale, stride_cb, stride_cs,
            BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, True, IEEE, INTERP,
        )  # fmt: skip
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@dataclass(frozen=True)
class TileConfig:
    """Launch parameters of an attention kernel. block_m: rows of a varlen program (query
    positions x padded group heads; ignored by decode); block_n: keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def varlen_config(max_query_len: int, group_pad: int, head_dim: int) -> TileConfig:
    """Default varlen tiles: 64 rows (fewer when every query run is short), 64 keys a step.

    Tuned on an H100 at Qwen3-0.6B's shape (bf16, 16/8 heads, head_dim 128): for 8 x 1024-token
    prefills 64 x 64 tiles with 4 warps and 2 stages ran 15% faster than 128-row tiles with 8 warps,
    and a chunked-prefill step with 63 decodes mixed in ran 30% faster.
    """
    block_m = min(64, max(_MIN_DOT_ROWS, triton.next_power_of_2(max(1, max_query_len) * group_pad)))
    return TileConfig(
        block_m=max(block_m, group_pad),
        block_n=64 if head_dim <= 128 else 32,
        num_warps=4,
        num_stages=2,
    )


DECODE_BLOCK_N_ENV = "VLLM_ACTORS_DECODE_BLOCK_N"


def decode_config(head_dim: int) -> TileConfig:
    """Default decode tiles: 128 keys a step (``VLLM_ACTORS_DECODE_BLOCK_N`` overrides), 4 warps,
    3 stages; 32 keys above head_dim 128.

    Swept on an H100 over the decode batches of nano-vllm's workload (`bench/decode_sweep.py`,
    2026-11-26): 128-key tiles took 3.6% less time than 64-key tiles at Qwen3-0.6B's shape (16/8
    heads) and 5% less at Qwen3-8B's per-rank shape under TP=2 (16/4 heads); 8 warps, or 2 or 4
    stages, did not help. The offline run went from 18,965 to 19,545 tok/s.
    """
    text = os.environ.get(DECODE_BLOCK_N_ENV, "128")
    if text not in ("16", "32", "64", "128", "256"):
        raise ValueError(f"{DECODE_BLOCK_N_ENV} must be a power of two in 16..256, got {text!r}")
    block_n = int(text) if head_dim <= 128 else 32
    return TileConfig(block_m=_MIN_DOT_ROWS, block_n=block_n, num_warps=4, num_stages=3)


def paged_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    config: TileConfig | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence's new queries over its paged context (already in the cache).

    q, out: [T, num_heads, head_dim]; query_start_loc [B+1] int32; seq_lens [B] int32;
    block_tables [B, max_blocks] int32; max_query_len: a host upper bound of the query lengths
    (only picks tile sizes, unless config gives them).
    """
    num_tokens, num_heads, head_dim = q.shape
    _check_cache_pair(k_cache, v_cache)
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_shapes(q, k_cache, out)
    q = _last_dim_contiguous(q)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    cfg = config or varlen_config(max_query_len, group_pad, head_dim)
    if cfg.block_m % group_pad or cfg.block_m < _MIN_DOT_ROWS:
        raise ValueError(f"block_m {cfg.block_m} must be >= {_MIN_DOT_ROWS} and a multiple of {group_pad}")
    block_q = cfg.block_m // group_pad
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _varlen_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        num_seqs,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        IEEE=q.dtype == torch.float32,
        INTERP=INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


# ----------------------------------------------------------------------------------------------
# Decode: one query per sequence, split along the context
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    order_ptr,
    num_heads,
    num_splits,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    ORDERED: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    if ORDERED:  # longest context first: the GPU starts the longest programs first (less tail)
        seq = tl.load(order_ptr + tl.program_id(0)).to(tl.int32)
    else:
        seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_ptr + seq)
    has_query = tl.load(query_start_ptr + seq + 1) > q_row
    seq_len = tl.where(has_query, tl.load(seq_lens_ptr + seq), 0)
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    tile_begin = split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, num_tiles)

    rows = tl.arange(0, ROWS)
    row_ok = rows < GROUP
    row_out = rows < tl.where(has_query, GROUP, 0)
    head = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + q_row.to(tl.int64) * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_out[:, None],
        other=0.0,
    )
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_ch
    for tile in range(tile_begin, tile_end):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, tile * BLOCK_N,
            seq_len, rows, qk_scale, stride_cb, stride_cs,
            ROWS, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, False, IEEE, INTERP,
        )  # fmt: skip
    # an empty range (short sequence, late split, or no query) leaves l_i == 0: write zeros
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        part_row = (seq.to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None])
        tl.store(part_max_ptr + part_row, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_ok)
    else:
        tl.store(
            out_ptr + q_row.to(tl.int64) * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_out[:, None],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    query_start_ptr,
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) <= q_row:
        return
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    part_row = (seq.to(tl.int64) * num_heads + head) * num_splits + splits
    part_max = tl.load(part_max_ptr + part_row, mask=split_ok, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part_row, mask=split_ok, other=0.0)
    dims = tl.arange(0, HEAD_DIM)
    part_out = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None], other=0.0)
    global_max = tl.maximum(tl.max(part_max, 0), -1e30)  # finite even when every split is empty
    weight = tl.where(part_sum > 0, part_sum * tl.exp2(part_max - global_max), 0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(part_out * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty))


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


DECODE_WAVES_ENV = "VLLM_ACTORS_DECODE_WAVES"


def decode_waves() -> int:
    """``VLLM_ACTORS_DECODE_WAVES`` (default 2): how many programs per SM the decode kernel's split
    aims at. More splits each context into shorter, more even pieces, which may matter where few
    KV heads per rank (TP) leave few programs and their contexts differ in length; read where the
    split is chosen, so at graph capture for CUDA graphs."""
    text = os.environ.get(DECODE_WAVES_ENV, "2")
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{DECODE_WAVES_ENV} must be a positive integer, got {text!r}")
    return int(text)


DECODE_ORDER_ENV = "VLLM_ACTORS_DECODE_ORDER"


def decode_ordered() -> bool:
    """``VLLM_ACTORS_DECODE_ORDER`` (default 1): the decode kernel takes the batch's sequences
    longest context first (one argsort a step), so that the last programs to start are short and
    the GPU's last wave ends evenly; 0 takes them in batch order."""
    text = os.environ.get(DECODE_ORDER_ENV, "1")
    if text not in ("0", "1"):
        raise ValueError(f"{DECODE_ORDER_ENV} must be 0 or 1, got {text!r}")
    return text == "1"


def choose_decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits of the context per (sequence, KV head): enough programs for about two waves on the
    GPU (``decode_waves``), but no split shorter than _MIN_KEYS_PER_SPLIT keys; rounded down to a
    power of two (bounds the reduce kernel's compiled variants)."""
    programs = max(1, num_seqs * num_kv_heads)
    wanted = math.ceil(decode_waves() * _sm_count(device) / programs)
    useful = math.ceil(max(1, max_seq_len) / _MIN_KEYS_PER_SPLIT)
    splits = max(1, min(wanted, useful, _MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    config: TileConfig | None = None,
    order: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence (query_len <= 1) over its paged context.

    Sequence i's query is row query_start_loc[i] of q (it has none when query_start_loc[i+1] equals
    it). max_seq_len is a host upper bound of seq_lens used only to pick the split count (pass the
    capture-time bound when recording a CUDA graph), or give num_splits directly. order, a
    permutation of the sequences (`decode_order`), is the order in which programs take them.
    """
    num_tokens, num_heads, head_dim = q.shape
    _check_cache_pair(k_cache, v_cache)
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_shapes(q, k_cache, out)
    q = _last_dim_contiguous(q)
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    rows = max(_MIN_DOT_ROWS, triton.next_power_of_2(group))
    if num_splits is None:
        num_splits = choose_decode_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    cfg = config or decode_config(head_dim)
    split = num_splits > 1
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_max = part_sum = out  # never touched
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_max,
        part_sum,
        query_start_loc,
        seq_lens,
        block_tables,
        seq_lens if order is None else order,  # never read when not ORDERED
        num_heads,
        num_splits,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        ROWS=rows,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        SPLIT=split,
        ORDERED=order is not None,
        IEEE=q.dtype == torch.float32,
        INTERP=INTERPRET,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out,
            part_out,
            part_max,
            part_sum,
            query_start_loc,
            num_heads,
            num_splits,
            out.stride(0),
            out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim,
            num_warps=4 if head_dim * num_splits >= 2048 else 2,
        )
    return out


# ----------------------------------------------------------------------------------------------
# Backend
# ----------------------------------------------------------------------------------------------


class TritonPagedAttention:
    """`AttentionBackend` on the Triton kernels: KV write, then decode (every query_len <= 1,
    judged from the host field `meta.max_query_len`) or varlen attention (anything else, decode
    rows mixed in included).

    decode_splits forces the decode split count (None: chosen per call from host integers).
    """

    def __init__(self, decode_splits: int | None = None, ordered: bool | None = None) -> None:
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits must be >= 1, got {decode_splits}")
        self.decode_splits = decode_splits
        self.ordered = decode_ordered() if ordered is None else ordered
        log.debug("triton_attention_backend", decode_splits=decode_splits, ordered=self.ordered, interpret=INTERPRET)

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """A decode step's metadata with `decode_order` (longest context first), when ordered."""
        if not self.ordered or meta.max_query_len > 1 or meta.num_seqs < 2 or meta.decode_order is not None:
            return meta
        return dataclasses.replace(meta, decode_order=torch.argsort(meta.seq_lens, descending=True))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_written: bool = False,
    ) -> torch.Tensor:
        if not kv_written:
            write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.max_query_len <= 1:
            return paged_attention_decode(
                q,
                k_cache,
                v_cache,
                meta.query_start_loc,
                meta.seq_lens,
                meta.block_tables,
                meta.max_seq_len,
                scale,
                num_splits=self.decode_splits,
                order=meta.decode_order,
            )
        return paged_attention_varlen(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            scale,
        )


# ----------------------------------------------------------------------------------------------
# Checks (host shapes only)
# ----------------------------------------------------------------------------------------------


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the Triton kernels need a power-of-two head_dim >= 16, got {head_dim}")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and strides")
    if k_cache.dim() != 4 or k_cache.stride(3) != 1:
        raise ValueError("caches must be [num_blocks, block_size, num_kv_heads, head_dim] with unit last stride")


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, out: torch.Tensor | None = None) -> None:
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q is {q.dtype} but the cache is {k_cache.dtype}")
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError(f"out must be {tuple(q.shape)} with a unit last stride, got {tuple(out.shape)}")
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    _check_head_dim(head_dim)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
