"""A KV-parallel rank's partial attention on the Triton kernels: output and log-sum-exp (natural
log, ``-inf`` and a zero output where the rank holds no key a query sees) over the rank's keys, read
through its share (``kv_parallel_share.RankShare``).

* ``partial_decode``: the split-KV decode kernel (``triton_decode._decode_kernel``) over the rank's
  dense run of keys (every key of a decode's sequence precedes its query: no mask but the length),
  its splits reduced here into the output and the LSE.
* ``partial_varlen``: prefill and mixed steps; each query's causal bound is the count of the rank's
  keys at or before its position (``kv_parallel_share``); keys from ``begin`` on (0, or the past
  another kernel attended).

No host sync and no size from tensor values: capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_actors.kernels import pdl as pdl_module
from vllm_actors.kernels.decode_merge import merge_splits
from vllm_actors.kernels.decode_splits import _sm_count, choose_decode_splits, few_programs
from vllm_actors.kernels.kv_parallel_share import RankShare
from vllm_actors.kernels.pdl import pdl
from vllm_actors.kernels.triton_decode import _decode_kernel, decode_config
from vllm_actors.kernels.triton_paged import (
    _LOG2E,
    _MIN_DOT_ROWS,
    INTERPRET,
    _attend_tile,
    checked_inputs,
    kv_scale_args,
)
from vllm_actors.kernels.triton_varlen import tile_sequence, varlen_config

# a window no row reaches past: `_attend_tile`'s WINDOW mode only for its guard of rows that see no key yet
_UNBOUNDED = tl.constexpr(1 << 30)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_lse_kernel(out_ptr, lse_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, query_start_ptr, num_heads,
                       num_splits, stride_ot, stride_oh, stride_lt,
                       SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_ptr + seq)
    if tl.load(query_start_ptr + seq + 1) <= q_row:
        return
    out, global_max, total = merge_splits(part_out_ptr, part_max_ptr, part_sum_ptr, seq, head, num_heads,
                                          num_splits, SPLITS_PAD, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    # the natural log (ln 2 = 0.693...): the scores are in the log2 domain
    lse = tl.where(total > 0, (global_max + tl.log2(tl.where(total > 0, total, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims, out)
    tl.store(lse_ptr + q_row.to(tl.int64) * stride_lt + head, lse)


def _outputs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 output [T, H, D] (zeros) and LSE [T, H] (-inf): rows no program writes stay so."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)


def partial_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                   share: RankShare, max_keys: int, scale: float, k_scale: torch.Tensor | None = None,
                   v_scale: torch.Tensor | None = None, logits_soft_cap: float | None = None,
                   num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence (query_len <= 1) over the rank's keys. ``max_keys``: a host bound of
    ``share.lens`` (picks the split count; the capture-time bound in a CUDA graph)."""
    q, _ = checked_inputs(q, k_cache, v_cache, None)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    out, lse = _outputs(q)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = share.lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out, lse
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_decode_splits(num_seqs, num_kv_heads, max_keys, q.device)
    cfg = decode_config(head_dim, few_programs(num_seqs, num_kv_heads, _sm_count(q.device)))
    part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    part_sum = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_max, part_sum, query_start_loc, share.lens, share.tables,
        share.lens, share.lens, scales.k_scale, scales.v_scale, num_heads, num_splits, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), share.tables.stride(0), 0, 0, (logits_soft_cap or 1.0) * _LOG2E,
        GROUP=group, ROWS=max(_MIN_DOT_ROWS, triton.next_power_of_2(group)), QUERIES=1, GROUPED=False,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, SPLIT=True, ORDERED=False, IEEE=q.dtype == torch.float32,
        INTERP=INTERPRET, **pdl(q), EARLY=pdl_module.early_loads(), KV_FP8=scales.fp8, WINDOW=False,
        SOFT_CAP=logits_soft_cap is not None, Q_F16=False, TAIL_MASK=False,  # fp8 as the query
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    _reduce_lse_kernel[(num_seqs, num_heads)](
        out, lse, part_out, part_max, part_sum, query_start_loc, num_heads, num_splits,
        out.stride(0), out.stride(1), lse.stride(0),
        SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
        num_warps=4 if head_dim * num_splits >= 2048 else 2,
    )  # fmt: skip
    return out, lse


@triton.jit
def _visible(owned_before_row_ptr, position, BLOCK_SIZE: tl.constexpr):
    """Keys of the rank's run at positions up to ``position`` (>= 0): see ``kv_parallel_share``."""
    block = position // BLOCK_SIZE
    before = tl.load(owned_before_row_ptr + block)
    held = tl.load(owned_before_row_ptr + block + 1) > before
    return before * BLOCK_SIZE + tl.where(held, position % BLOCK_SIZE + 1, 0)


@triton.jit(do_not_specialize=["num_seqs", "stride_bt", "stride_ob"])
def _varlen_lse_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, query_start_ptr, seq_lens_ptr, tables_ptr,
    owned_before_ptr, begin_ptr, k_scale_ptr, v_scale_ptr, num_seqs, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_cb, stride_cs, stride_ch, stride_bt, stride_ob,
    soft_cap,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
    INTERP: tl.constexpr, KV_FP8: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_BEGIN: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tile_sequence(query_start_ptr, num_seqs, tile, BLOCK_Q)  # as `triton_varlen` maps programs
    seq_q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - seq_q_start
    first_query = (tile - (seq_q_start // BLOCK_Q + seq)) * BLOCK_Q
    if first_query >= query_len:
        return
    prefix_len = tl.load(seq_lens_ptr + seq) - query_len
    # mypy sees the binary search's int start, not the tensor it becomes under the JIT
    owned_row_ptr = owned_before_ptr + seq.to(tl.int64) * stride_ob  # type: ignore[attr-defined]
    table_row_ptr = tables_ptr + seq.to(tl.int64) * stride_bt  # type: ignore[attr-defined]

    rows = tl.arange(0, BLOCK_M)
    query_index = first_query + rows // GROUP_PAD
    group_index = rows % GROUP_PAD
    row_ok = (query_index < query_len) & (group_index < GROUP)
    head = kv_head * GROUP + group_index
    dims = tl.arange(0, HEAD_DIM)
    token = (seq_q_start + query_index).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    # each row's causal bound as an index of the run: its last visible key (padding rows: the last row's)
    position = prefix_len + tl.minimum(query_index, query_len - 1)
    q_last = _visible(owned_row_ptr, position, BLOCK_SIZE) - 1
    qk = qk_scale
    if KV_FP8:
        qk = qk_scale * tl.load(k_scale_ptr)
    seen_by_all = _visible(owned_row_ptr, prefix_len + first_query, BLOCK_SIZE)
    keys_end = _visible(owned_row_ptr, prefix_len + tl.minimum(first_query + BLOCK_Q, query_len) - 1, BLOCK_SIZE)
    begin = 0
    if HAS_BEGIN:
        begin = tl.load(begin_ptr + seq)
    unmasked_end = begin + tl.maximum(seen_by_all - begin, 0) // BLOCK_N * BLOCK_N

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    kv_head_offset = kv_head.to(tl.int64) * stride_ch
    for key_start in range(begin, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, key_start,
            keys_end, q_last, qk, stride_cb, stride_cs, 0, soft_cap,
            BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, False, IEEE, INTERP, KV_FP8, False, SOFT_CAP,
        )  # fmt: skip
    for key_start in range(unmasked_end, keys_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, key_start,
            keys_end, q_last, qk, stride_cb, stride_cs, _UNBOUNDED, soft_cap,
            BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, True, IEEE, INTERP, KV_FP8, True, SOFT_CAP,
        )  # fmt: skip
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :], out,
             mask=row_ok[:, None])
    tl.store(lse_ptr + token * stride_lt + head, lse, mask=row_ok)


def partial_varlen(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_start_loc: torch.Tensor,
                   seq_lens: torch.Tensor, share: RankShare, max_query_len: int, scale: float,
                   k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                   logits_soft_cap: float | None = None, begin: torch.Tensor | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every sequence's new queries over the rank's keys (``seq_lens``: the
    sequences' whole lengths; ``begin`` [B]: the first key of the run to attend, None for 0)."""
    q, _ = checked_inputs(q, k_cache, v_cache, None)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    out, lse = _outputs(q)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out, lse
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    cfg = varlen_config(max_query_len, group_pad, head_dim)
    block_q = cfg.block_m // group_pad
    _varlen_lse_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, lse, query_start_loc, seq_lens, share.tables, share.owned_before,
        share.lens if begin is None else begin, scales.k_scale, scales.v_scale, num_seqs, scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0), k_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2), share.tables.stride(0), share.owned_before.stride(0),
        (logits_soft_cap or 1.0) * _LOG2E,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, IEEE=q.dtype == torch.float32, INTERP=INTERPRET,
        KV_FP8=scales.fp8, SOFT_CAP=logits_soft_cap is not None, HAS_BEGIN=begin is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out, lse
