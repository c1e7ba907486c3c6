"""Triton kernels for paged attention, and `TritonPagedAttention`, the backend built on them.

Same contract as `vllm_actors.kernels.attention`: per layer, `k_cache` and `v_cache` are
`[num_blocks, block_size, num_kv_heads, head_dim]`; a step's new tokens of B sequences are
flattened to T rows; each sequence's new queries are the last `query_len` positions of its
`seq_len` context and attend causally to all of it, read through its block table.

Kernels:

* `write_kv_cache_triton` scatters the new tokens' k and v into the caches at `slot_mapping`;
  a negative slot is skipped (the padding rows of a CUDA-graph batch). An fp8 cache stores them
  quantised by the layer's k_scale / v_scale and is read back through them (`triton_paged`).
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
  only the work per split grows). Consecutive decode rows of one sequence (a verification step's,
  ``meta.decode_groups``) share programs: one reads the KV once for several of them (`triton_decode`).

No kernel launch here syncs with the host or sizes anything from tensor values: the decode path
can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import structlog
import torch

from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill

if TYPE_CHECKING:
    from vllm_actors.kernels.fp8_prefill_stage import Fp8PrefillStaging
from vllm_actors.kernels.decode_splits import DECODE_MAX_SPLITS, DECODE_WAVES, choose_decode_splits, few_programs
from vllm_actors.kernels.triton_decode import (
    DECODE_BLOCK_N,
    DECODE_ORDERED,
    decode_config,
    paged_attention_decode,
    queries_per_program,
)
from vllm_actors.kernels.triton_paged import INTERPRET, TileConfig, write_kv_cache_triton
from vllm_actors.kernels.triton_varlen import paged_attention_varlen, varlen_config

__all__ = [
    "DECODE_BLOCK_N",
    "DECODE_MAX_SPLITS",
    "DECODE_ORDERED",
    "DECODE_WAVES",
    "INTERPRET",
    "TileConfig",
    "TritonPagedAttention",
    "choose_decode_splits",
    "decode_config",
    "few_programs",
    "paged_attention_decode",
    "paged_attention_varlen",
    "varlen_config",
    "write_kv_cache_triton",
]

log = structlog.get_logger(__name__)


# ----------------------------------------------------------------------------------------------
# Backend
# ----------------------------------------------------------------------------------------------


class TritonPagedAttention:
    """`AttentionBackend` on the Triton kernels: KV write (unless the caller's rotary launch did
    it: `kv_written`), then decode (every query_len <= 1, judged from the host field
    `meta.max_query_len`) or varlen attention (anything else, decode rows mixed in included).

    decode_splits forces the decode split count (None: chosen per call from host integers);
    ordered takes decode sequences longest context first (default ``DECODE_ORDERED``); prefill, when
    given, attends the non-decode steps it wants (flash-attn 4 on Hopper) in place of the varlen kernel;
    staging, set by the runner over an fp8 cache, attends its long one-sequence chunks through flash-attn
    (``fp8_prefill_stage.py``).
    """

    def __init__(
        self, decode_splits: int | None = None, ordered: bool | None = None, prefill: FlashAttnPrefill | None = None
    ) -> None:
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits must be >= 1, got {decode_splits}")
        self.decode_splits = decode_splits
        self.ordered = DECODE_ORDERED if ordered is None else ordered
        self.prefill = prefill
        self.staging: Fp8PrefillStaging | None = None
        log.debug("triton_attention_backend", decode_splits=decode_splits, ordered=self.ordered, interpret=INTERPRET,
                  prefill=prefill.choice if prefill is not None else "triton")

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """A decode step's metadata with `decode_order` (longest context first), when ordered."""
        if not self.ordered or meta.max_query_len > 1 or meta.num_seqs < 2 or meta.decode_order is not None:
            return meta
        return dataclasses.replace(meta, decode_order=torch.argsort(meta.seq_lens, descending=True))

    @staticmethod
    def decode_queries_per_read(num_heads: int, num_kv_heads: int) -> int:
        """Queries of a decode query group (``meta.decode_groups``) attended with one read of their KV."""
        return queries_per_program(num_heads, num_kv_heads)

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
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        if not kv_written:
            write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
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
                k_scale=k_scale,
                v_scale=v_scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
                decode_groups=meta.decode_groups,
                total_seq_len=decode_keys(meta),
            )
        if self.staging is not None and self.staging.wants(q, k_cache, meta, sliding_window, logits_soft_cap):
            return self.staging(q, k_cache, v_cache, meta, scale, k_scale, v_scale, logits_soft_cap)
        if self.prefill is not None and self.prefill.wants(q, k_cache, v_cache, meta, sliding_window, logits_soft_cap):
            return self.prefill(q, k_cache, v_cache, meta, scale, sliding_window, logits_soft_cap)
        return paged_attention_varlen(
            q,
            k_cache,
            v_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.max_query_len,
            scale,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )


def decode_keys(meta: AttentionMetadata) -> int | None:
    """The decode step's keys together, from the host's lengths (a long context among short ones gets more
    splits: ``choose_decode_splits``); None while a CUDA graph is captured (it serves any lengths)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return None
    return meta.keys_in_step() if meta.seq_lens_cpu else None
