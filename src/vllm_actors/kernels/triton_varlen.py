"""Varlen paged attention (prefill, chunked prefill, mixed batches): `paged_attention_varlen`; see
`triton_attention`'s docstring for how programs map to sequences."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_actors.kernels.attention import check_attention_options
from vllm_actors.kernels.triton_paged import (
    _LOG2E,
    _MIN_DOT_ROWS,
    INTERPRET,
    TileConfig,
    _attend_tile,
    checked_inputs,
    kv_scale_args,
)


# Integer arguments that change with the batch (sequence count, block-table width, splits) are
# not specialised: Triton would otherwise compile a new variant, mid-serving, the first time such
# a value is 1 or a multiple of 16 (the likely cause of a 1.26 s stall in a benchmark on the H100).
@triton.jit
def tile_sequence(query_start_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The sequence a program tile belongs to: the last i with qsl[i] // BLOCK_Q + i <= tile (each
    sequence's query tiles follow one another, a sequence's first tile at qsl[i] // BLOCK_Q + i)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first_tile <= tile, mid + 1, lo)
        hi = tl.where(first_tile <= tile, hi, mid)
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _varlen_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    window,
    soft_cap,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    KV_FP8: tl.constexpr,  # an fp8 cache: k_scale folds into qk_scale, v_scale into the output
    WINDOW: tl.constexpr,  # a sliding window of `window` keys
    SOFT_CAP: tl.constexpr,  # scores soft-capped at `soft_cap` (log2 domain)
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tile_sequence(query_start_ptr, num_seqs, tile, BLOCK_Q)
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
    qk = qk_scale
    if KV_FP8:
        qk = qk_scale * tl.load(k_scale_ptr)

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
    full_start = 0
    if WINDOW:
        # keys below the first row's window are seen by no row: skipped; keys from the last row's
        # window start on are seen by every row (up to unmasked_end); between them, masked tiles
        last_pos = prefix_len + tl.minimum(first_query + BLOCK_Q, query_len) - 1
        window_start = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        full_start = tl.minimum(tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N, unmasked_end)
        for key_start in range(window_start, full_start, BLOCK_N):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, key_start,
                seq_len, q_pos, qk, stride_cb, stride_cs, window, soft_cap,
                BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, True, IEEE, INTERP, KV_FP8, True, SOFT_CAP,
            )  # fmt: skip
    for key_start in range(full_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, key_start,
            seq_len, q_pos, qk, stride_cb, stride_cs, window, soft_cap,
            BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, False, IEEE, INTERP, KV_FP8, False, SOFT_CAP,
        )  # fmt: skip
    for key_start in range(unmasked_end, keys_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, key_start,
            seq_len, q_pos, qk, stride_cb, stride_cs, window, soft_cap,
            BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, True, IEEE, INTERP, KV_FP8, WINDOW, SOFT_CAP,
        )  # fmt: skip
    if WINDOW:  # a padding row past the sequence may see no key: no 0/0 there
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    else:
        out = acc / l_i[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence's new queries over its paged context (already in the cache).

    q, out: [T, num_heads, head_dim]; query_start_loc [B+1] int32; seq_lens [B] int32;
    block_tables [B, max_blocks] int32; max_query_len: a host upper bound of the query lengths
    (only picks tile sizes, unless config gives them); k_scale, v_scale: an fp8 cache's scales;
    sliding_window, logits_soft_cap: the layer's options (`kernels/attention.py`), None for off.
    """
    check_attention_options(sliding_window, logits_soft_cap)
    q, out = checked_inputs(q, k_cache, v_cache, out)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
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
        scales.k_scale,
        scales.v_scale,
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
        sliding_window or 0,
        (logits_soft_cap or 1.0) * _LOG2E,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        IEEE=q.dtype == torch.float32,
        INTERP=INTERPRET,
        KV_FP8=scales.fp8,
        WINDOW=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
