"""Decode paged attention (one query per sequence, the context split across programs):
`paged_attention_decode`, its tile config and program order (its split rule: ``decode_splits``); see
`triton_attention`'s docstring for the contract.

Query groups (``decode_groups``): consecutive decode rows that are one sequence's consecutive positions
(a verification step as decode rows, ``runner/verify_rows.py``) are attended by one program per
(group chunk, KV head, split): its tile rows hold ``queries_per_program`` queries x the KV head's
query heads, each KV tile is loaded once for all of them, and row i sees keys below its own length."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_actors.envs import envs
from vllm_actors.kernels import pdl as pdl_module
from vllm_actors.kernels.attention import check_attention_options
from vllm_actors.kernels.decode_merge import _decode_reduce_kernel
from vllm_actors.kernels.decode_splits import _sm_count, choose_decode_splits, few_programs
from vllm_actors.kernels.pdl import pdl, pdl_enter
from vllm_actors.kernels.triton_paged import (
    _LOG2E,
    _MIN_DOT_ROWS,
    INTERPRET,
    TileConfig,
    _attend_tile,
    checked_inputs,
    kv_scale_args,
)

F16_MAX = tl.constexpr(65504.0)
NO_SCORE = tl.constexpr(-1e30)  # a running max below every score: exp2 of its differences stays finite
# The decode kernel's tuning, from sweeps over the decode batches of a serving workload
# (benchmarks/RESULTS.md): keys a tile and sequences taken longest context first (the last wave ends
# evenly); the split count's in ``decode_splits``.
DECODE_BLOCK_N = 128
DECODE_ORDERED = True
# How an fp8 cache's tiles meet the query in the dots (`fp8_tiles`). "query": converted to the query's
# dtype; for bf16 on Hopper three conversions per two elements (e4m3 -> f16x2, each half -> bf16), on a
# pipe of 16 a clock per SM. "float16": one conversion per two elements; the query carries the softmax
# scale and k_scale and is cast to fp16 once (saturated at its range), the probabilities are fp16 (finer
# than bf16 in [0, 1]), and only the tiles reaching past the sequence's end are masked: a third fewer
# instructions a loop in sm_90 SASS (docs/performance.md). Float32 queries always take "query".
FP8_TILES = ("query", "float16")
DECODE_FP8_TILES: str = envs.VLLM_ACTORS_DECODE_FP8_TILES  # read at import, as the engine's kernels are


def decode_config(head_dim: int, few: bool = False) -> TileConfig:
    """Decode tiles: ``DECODE_BLOCK_N`` keys a step (32 above head_dim 128), 4 warps, 3 stages (2 for
    ``few`` programs)."""
    block_n = DECODE_BLOCK_N if head_dim <= 128 else 32
    return TileConfig(block_m=_MIN_DOT_ROWS, block_n=block_n, num_warps=4, num_stages=2 if few else 3)


# ----------------------------------------------------------------------------------------------
# Decode: one query per sequence, split along the context
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_splits", "stride_bt", "stride_groups"])
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
    groups_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    stride_groups,
    window,
    soft_cap,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    QUERIES: tl.constexpr,  # queries a program takes: 1, or (GROUPED) its tile rows' share of the group
    GROUPED: tl.constexpr,  # rows in query groups: groups_ptr [2, rows] holds each row's group's first and end row
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SPLIT: tl.constexpr,
    ORDERED: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,  # the step's metadata (written before its first kernel) read before the PDL wait
    KV_FP8: tl.constexpr,  # an fp8 cache: k_scale folds into qk_scale, v_scale into the output
    Q_F16: tl.constexpr,  # fp8 tiles read as fp16: q carries qk_scale (and k_scale) and is cast to fp16
    TAIL_MASK: tl.constexpr,  # only tiles reaching past the sequence's end are masked (not with WINDOW)
    WINDOW: tl.constexpr,  # a sliding window of `window` keys: the splits share only its tiles
    SOFT_CAP: tl.constexpr,  # scores soft-capped at `soft_cap` (log2 domain)
):
    if not EARLY:
        pdl_enter(PDL)
    if ORDERED:  # longest context first: the GPU starts the longest programs first (less tail)
        seq = tl.load(order_ptr + tl.program_id(0)).to(tl.int32)
    else:
        seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_ptr + seq)
    has_query = tl.load(query_start_ptr + seq + 1) > q_row
    rows = tl.arange(0, ROWS)
    query = rows // GROUP  # tile row -> (query of the program, head of the group)
    head = kv_head * GROUP + rows % GROUP
    row_ok = rows < QUERIES * GROUP
    if GROUPED:  # a chunk of QUERIES rows of the group is led by its first row; the others' programs idle
        first = tl.load(groups_ptr + seq)
        count = tl.minimum(tl.load(groups_ptr + stride_groups + seq) - seq, QUERIES)
        count = tl.where(has_query & ((seq - first) % QUERIES == 0), count, 0)
        row_out = row_ok & (query < count)
        lens = tl.load(seq_lens_ptr + seq + query, mask=row_out, other=0)  # the rows' own lengths
        seq_len = tl.max(lens, 0)
        first_len = tl.where(count > 0, tl.load(seq_lens_ptr + seq), 0)
    else:
        row_out = rows < tl.where(has_query, GROUP, 0)
        seq_len = tl.where(has_query, tl.load(seq_lens_ptr + seq), 0)
        first_len = seq_len
        lens = rows * 0 + seq_len  # every row is the sequence's newest position
    if EARLY:  # q and the newest token's k and v come from the kernel before: read after the wait
        pdl_enter(PDL)
    if GROUPED:
        if count == 0:  # a row its group's leading program attends
            return
    qk = qk_scale
    if KV_FP8:
        qk = qk_scale * tl.load(k_scale_ptr)
    end_tile = tl.cdiv(seq_len, BLOCK_N)
    first_tile = 0
    if WINDOW:
        first_tile = tl.maximum(first_len - window, 0) // BLOCK_N
    tiles_per_split = tl.cdiv(end_tile - first_tile, num_splits)
    tile_begin = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_begin + tiles_per_split, end_tile)

    dims = tl.arange(0, HEAD_DIM)
    token = q_row + query  # the rows' q and out rows
    q = tl.load(
        q_ptr + token.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_out[:, None],
        other=0.0,
    )
    if Q_F16:  # the scores come out of the dot in the log2 domain: no multiply a tile
        q = tl.minimum(tl.maximum(q.to(tl.float32) * qk, -F16_MAX), F16_MAX).to(tl.float16)
        qk = 1.0
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    # finite: a grouped row may see no key of its split's first tiles (exp2(-inf - -inf) is NaN)
    m_i = tl.full([ROWS], NO_SCORE, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_offset = kv_head.to(tl.int64) * stride_ch
    q_pos = lens - 1
    masked_from = tile_begin
    if TAIL_MASK:  # the tiles wholly inside every row's sequence skip the key mask (none in a window)
        masked_from = tl.maximum(tl.minimum(tile_end, first_len // BLOCK_N), tile_begin)
        for tile in range(tile_begin, masked_from):
            acc, m_i, l_i = _attend_tile(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, tile * BLOCK_N,
                seq_len, q_pos, qk, stride_cb, stride_cs, window, soft_cap,
                ROWS, BLOCK_N, BLOCK_SIZE, HEAD_DIM, False, False, IEEE, INTERP, KV_FP8, WINDOW, SOFT_CAP,
            )  # fmt: skip
    for tile in range(masked_from, tile_end):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head_offset, tile * BLOCK_N,
            seq_len, q_pos, qk, stride_cb, stride_cs, window, soft_cap,
            ROWS, BLOCK_N, BLOCK_SIZE, HEAD_DIM, True, GROUPED, IEEE, INTERP, KV_FP8, WINDOW, SOFT_CAP,
        )  # fmt: skip
    # an empty range (short sequence, late split, or no query) leaves l_i == 0: write zeros
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if KV_FP8:
        out = out * tl.load(v_scale_ptr)
    if SPLIT:
        part_row = ((seq + query).to(tl.int64) * num_heads + head) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + dims[None, :], out, mask=row_out[:, None])
        tl.store(part_max_ptr + part_row, m_i, mask=row_out)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_out)
    else:
        tl.store(
            out_ptr + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_out[:, None],
        )


def queries_per_program(num_heads: int, num_kv_heads: int) -> int:
    """Queries of a group one decode program attends with each KV tile load (its tile rows, at least
    ``_MIN_DOT_ROWS``, over the query heads a KV head serves)."""
    group = num_heads // num_kv_heads
    return max(_MIN_DOT_ROWS, triton.next_power_of_2(group)) // group


def check_decode_groups(decode_groups: torch.Tensor, num_seqs: int) -> None:
    """A ValueError unless ``decode_groups`` is an int32 [2, num_seqs] tensor with a unit last stride."""
    if decode_groups.dtype != torch.int32 or tuple(decode_groups.shape) != (2, num_seqs) \
            or decode_groups.stride(1) != 1:
        raise ValueError(f"decode_groups must be int32 [2, {num_seqs}] with a unit last stride (each row's "
                         f"group's first and end row), got {decode_groups.dtype} {tuple(decode_groups.shape)}")


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    fp8_tiles: str | None = None,
    decode_groups: torch.Tensor | None = None,
    total_seq_len: int | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence (query_len <= 1) over its paged context.

    Sequence i's query is row query_start_loc[i] of q (it has none when query_start_loc[i+1] equals
    it). max_seq_len is a host upper bound of seq_lens used only to pick the split count (pass the
    capture-time bound when recording a CUDA graph), or give num_splits directly; total_seq_len, the
    host's sum of seq_lens where it has them (None: taken as uniform), lets a long context among short
    ones get more splits (``choose_decode_splits``). order, a
    permutation of the sequences (`decode_order`), is the order in which programs take them.
    k_scale, v_scale: an fp8 cache's scales; sliding_window, logits_soft_cap: the layer's options
    (`kernels/attention.py`), None for off. fp8_tiles: how an fp8 cache's tiles are converted
    (``FP8_TILES``; None: ``DECODE_FP8_TILES``).
    decode_groups: int32 [2, num_seqs], for each sequence the first and the end (exclusive) sequence of
    its query group (the module docstring): the group's sequences are one sequence's consecutive positions,
    one query each, the same block table, each length one more than the one before; a sequence alone is
    its own group (first = itself, end = itself + 1). None: every sequence alone.
    """
    check_attention_options(sliding_window, logits_soft_cap)
    q, out = checked_inputs(q, k_cache, v_cache, out)
    scales = kv_scale_args(k_cache, k_scale, v_scale)
    fp8_tiles = fp8_tiles or DECODE_FP8_TILES
    if fp8_tiles not in FP8_TILES:
        raise ValueError(f"fp8_tiles must be one of {FP8_TILES}, got {fp8_tiles!r}")
    q_f16 = scales.fp8 and fp8_tiles != "query" and q.dtype != torch.float32
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    rows = max(_MIN_DOT_ROWS, triton.next_power_of_2(group))
    if decode_groups is not None:
        check_decode_groups(decode_groups, num_seqs)
    if num_splits is None:
        keys = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)  # keys a query reads
        total = total_seq_len if sliding_window is None else None
        num_splits = choose_decode_splits(num_seqs, num_kv_heads, keys, q.device, total_seq_len=total)
    cfg = config or decode_config(head_dim, few_programs(num_seqs, num_kv_heads, _sm_count(q.device)))
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
        seq_lens if decode_groups is None else decode_groups,  # never read when not GROUPED
        scales.k_scale,
        scales.v_scale,
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
        0 if decode_groups is None else decode_groups.stride(0),
        sliding_window or 0,
        (logits_soft_cap or 1.0) * _LOG2E,
        GROUP=group,
        ROWS=rows,
        QUERIES=1 if decode_groups is None else queries_per_program(num_heads, num_kv_heads),
        GROUPED=decode_groups is not None,
        BLOCK_N=cfg.block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        SPLIT=split,
        ORDERED=order is not None,
        IEEE=q.dtype == torch.float32,
        INTERP=INTERPRET,
        **pdl(q),
        EARLY=pdl_module.early_loads(),
        KV_FP8=scales.fp8,
        Q_F16=q_f16,
        TAIL_MASK=q_f16 and sliding_window is None,
        WINDOW=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers and not INTERPRET else {}),
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
            **pdl(q),
            EARLY=pdl_module.early_loads(),
            num_warps=4 if head_dim * num_splits >= 2048 else 2,
        )
    return out

