"""A KV-parallel rank's partial attention on the GPU kernels (``kv_parallel_triton``), and on
flash-attn 4 for the past of a prefill where the prefill choice picks it.

Decode steps take the split-KV decode kernel. Prefill and mixed steps take the varlen kernel over
the rank's keys; where flash-attn 4 wants the step (``FlashAttnPrefill.wants``), it attends the
keys before each chunk's first query, which every query of the chunk sees (no mask: ``causal=False``
over the first ``share.past`` keys of the run), and the varlen kernel the chunk's own keys from
there; the two partials merge by their LSE like the ranks'. Layers with a sliding window are left
to the torch reference (``kv_parallel.partial_paged_attention``) by the caller.
"""

from __future__ import annotations

import dataclasses

import torch

from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill, varlen_arguments
from vllm_actors.kernels.kv_parallel_share import RankShare, merge_partials
from vllm_actors.kernels.kv_parallel_triton import partial_decode, partial_varlen


def flash_attn_past(prefill: FlashAttnPrefill, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, share: RankShare, scale: float,
                    logits_soft_cap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query over the rank's keys before its chunk (``share.past``), unmasked, by flash-attn 4:
    float32 output [T, H, D] and LSE [T, H] (0 and -inf for a sequence with no such key)."""
    past_meta = dataclasses.replace(meta, seq_lens=share.past, block_tables=share.tables)
    arguments = varlen_arguments(q, k_cache, v_cache, past_meta, scale, None, logits_soft_cap, prefill.pack_gqa)
    arguments.update(causal=False, return_lse=True)
    out, lse = prefill.caller()(**arguments)
    num_tokens, num_heads = q.shape[:2]
    if lse.shape == (num_heads, num_tokens):  # flash-attn's varlen layout: head-major
        lse = lse.transpose(0, 1)
    tokens = torch.arange(num_tokens, device=q.device)
    seq_of_token = torch.searchsorted(meta.query_start_loc[1:].long(), tokens, right=True)
    has_past = (share.past.long().index_select(0, seq_of_token.clamp(max=share.past.shape[0] - 1)) > 0)
    has_past = has_past.unsqueeze(1)
    lse = torch.where(has_past, lse.float(), float("-inf"))
    return torch.where(has_past.unsqueeze(2), out.float(), 0.0), lse


class GpuPartialAttention:
    """Dispatches a rank's partial attention (see the module docstring); ``prefill``: flash-attn 4's
    path where the device has it, None for the varlen kernel alone."""

    def __init__(self, prefill: FlashAttnPrefill | None = None, decode_splits: int | None = None) -> None:
        self.prefill = prefill
        self.decode_splits = decode_splits

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 share: RankShare, size: int, scale: float, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None,
                 logits_soft_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rank's float32 output [T, H, D] and LSE [T, H] (``size``: the ranks, bounds its keys)."""
        if meta.max_query_len <= 1:
            block_size = k_cache.shape[1]
            max_keys = -(-meta.max_seq_len // (size * block_size)) * block_size  # the rank's share, interleaved
            return partial_decode(q, k_cache, v_cache, meta.query_start_loc, share, max_keys, scale, k_scale, v_scale,
                                  logits_soft_cap, num_splits=self.decode_splits)
        if self.prefill is None or not self.prefill.wants(q, k_cache, v_cache, meta, None, logits_soft_cap):
            return partial_varlen(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, share, meta.max_query_len,
                                  scale, k_scale, v_scale, logits_soft_cap)
        past = flash_attn_past(self.prefill, q, k_cache, v_cache, meta, share, scale, logits_soft_cap)
        chunk = partial_varlen(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, share, meta.max_query_len,
                               scale, k_scale, v_scale, logits_soft_cap, begin=share.past)
        lses = torch.stack((past[1], chunk[1]))
        return merge_partials(torch.stack((past[0], chunk[0])), lses), torch.logsumexp(lses, dim=0)
