"""KV-parallel attention: each rank attends to its share of every sequence's KV and the ranks'
partial outputs merge exactly by their log-sum-exp.

Block id ``b`` of a block table lives on KV-parallel rank ``b % size`` as its local block
``b // size`` (``actors/kv_cache_manager/block_pool.py`` places a request's ``j``-th block on rank
``j % size`` where it can). Every rank gets the step's queries (all of them: the linear layers run
on every rank), stores the new tokens' K/V only where it owns their block, and attends to the keys
of its own blocks, by their absolute positions (the causal mask and a sliding window need no other
change). Its output ``o_r`` (normalised by its own softmax sum) and ``lse_r`` (the log of that sum,
``-inf`` where it holds no key a query sees) are exchanged in one all-gather of ``[T, H, D + 1]``
per layer, whose size does not grow with the context, and every rank merges them alike:
``o = sum_r exp(lse_r - L) o_r`` with ``L = logsumexp_r lse_r``.

The attention here is a torch loop over the sequences (the CPU's engine, and the reference of the
kernel tests against plain attention in float64). Given ``kernels`` (on CUDA), the rank attends on
the GPU kernels instead (``kv_parallel_gpu.py``): its share of the blocks is worked out once a step
on the device (``prepare``, ``kv_parallel_share.py``), the K/V write skips other ranks' tokens by
their slot -1, and nothing syncs with the host, so decode and padded steps run in CUDA graphs (the
all-gather is NCCL's ``all_gather_into_tensor``, capturable). Layers with a sliding window stay on
the torch loop, eagerly (``capturable`` is False for such a model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.attention import AttentionMetadata, check_attention_options, write_kv_cache
from vllm_actors.kernels.kv_parallel_share import RankShare, merge_partials, rank_share

if TYPE_CHECKING:
    from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention

# Stacks every KV-parallel rank's tensor: [T, H, D + 1] on each rank -> [size, T, H, D + 1], in rank order.
Exchange = Callable[[torch.Tensor], torch.Tensor]


def local_slots(slot_mapping: torch.Tensor, block_size: int, rank: int, size: int) -> torch.Tensor:
    """The slots of ``slot_mapping`` (global block ids) in rank ``rank``'s own cache, -1 for the
    tokens whose block another rank holds (and for padding rows, already -1)."""
    block = torch.div(slot_mapping, block_size, rounding_mode="floor")
    own = (slot_mapping >= 0) & (block % size == rank)
    local = torch.div(block, size, rounding_mode="floor") * block_size + slot_mapping % block_size
    return torch.where(own, local, torch.full_like(slot_mapping, -1))


def partial_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    rank: int,
    size: int,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of the attention of ``q`` ([T, H, D]) over the sequences of ``meta``
    (global block tables; ``k_cache``/``v_cache``: this rank's own blocks). Returns its output
    [T, H, D] and log-sum-exp [T, H] (``-inf`` where none of its keys is seen), in float32, or in
    float64 for float64 queries."""
    check_attention_options(sliding_window, logits_soft_cap)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    wide = torch.promote_types(q.dtype, torch.float32)
    fp8 = kv_quant.is_fp8(k_cache.dtype)
    out = torch.zeros((num_tokens, num_heads, head_dim), dtype=wide, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=wide, device=q.device)
    offsets = torch.arange(block_size, device=q.device)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 0:
            continue
        table = meta.block_tables[i, : (seq_len + block_size - 1) // block_size].long()
        own = torch.nonzero(table % size == rank).flatten()  # the block indices this rank holds
        if own.numel():
            local = torch.div(table[own], size, rounding_mode="floor")
            keys = k_cache.index_select(0, local).reshape(-1, num_kv_heads, head_dim)
            values = v_cache.index_select(0, local).reshape(-1, num_kv_heads, head_dim)
            if fp8:
                keys = kv_quant.dequantize(keys, kv_quant.checked_scale(k_scale, k_cache))
                values = kv_quant.dequantize(values, kv_quant.checked_scale(v_scale, v_cache))
            k_pos = (own.unsqueeze(1) * block_size + offsets).reshape(-1)
            ki = keys.to(wide).transpose(0, 1).repeat_interleave(group, dim=0)  # [H, keys, D]
            vi = values.to(wide).transpose(0, 1).repeat_interleave(group, dim=0)
            qi = q[start : start + q_len].to(wide).transpose(0, 1)  # [H, q_len, D]
            scores = (qi @ ki.transpose(1, 2)) * scale
            if logits_soft_cap is not None:
                scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            # query j sits at absolute position seq_len - q_len + j (keys past seq_len are masked by it)
            q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
            mask = k_pos.unsqueeze(0) <= q_pos
            if sliding_window is not None:
                mask &= k_pos.unsqueeze(0) > q_pos - sliding_window
            scores = scores.masked_fill(~mask, float("-inf"))
            m = torch.logsumexp(scores, dim=-1)  # [H, q_len]
            probs = torch.exp(scores - torch.where(torch.isinf(m), 0.0, m).unsqueeze(-1))
            out[start : start + q_len] = (probs @ vi).transpose(0, 1)
            lse[start : start + q_len] = m.transpose(0, 1)
        start += q_len
    return out, lse


@dataclasses.dataclass
class KvParallelMetadata(AttentionMetadata):
    """A step's metadata on a rank attending on the GPU kernels: its share of the blocks too."""

    share: RankShare | None = None


class KvParallelAttention:
    """The attention backend of one KV-parallel rank (``size`` ranks, ``exchange`` their all-gather);
    ``kernels``: the GPU path (None: the torch loop); ``capturable``: whether its steps may be
    captured in CUDA graphs (the GPU path, no layer on the torch loop)."""

    def __init__(self, rank: int, size: int, block_size: int, exchange: Exchange,
                 kernels: GpuPartialAttention | None = None, capturable: bool = False) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"KV-parallel rank {rank} outside a group of {size}")
        self.rank, self.size, self.block_size, self.exchange = rank, size, block_size, exchange
        self.kernels = kernels
        self.capturable = capturable and kernels is not None

    @property
    def name(self) -> str:
        return "torch+kv_parallel" if self.kernels is None else "triton+kv_parallel"

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's metadata with its slots in this rank's cache (-1: another rank's block), so
        that a fused K/V write in the model stores only this rank's tokens; on the GPU path, with
        the rank's share of every sequence's blocks."""
        meta = dataclasses.replace(meta, slot_mapping=local_slots(meta.slot_mapping, self.block_size,
                                                                  self.rank, self.size))
        if self.kernels is None:
            return meta
        fields = {field.name: getattr(meta, field.name) for field in dataclasses.fields(AttentionMetadata)}
        return KvParallelMetadata(**fields, share=rank_share(meta, self.rank, self.size, self.block_size))

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
        """``meta``: from ``prepare`` (local slots). The merged attention output [T, H, D]."""
        share = meta.share if isinstance(meta, KvParallelMetadata) else None
        if self.kernels is not None and share is not None and sliding_window is None:
            if not kv_written:
                from vllm_actors.kernels.triton_paged import write_kv_cache_triton

                write_kv_cache_triton(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)  # -1: skipped
            out, lse = self.kernels(q, k_cache, v_cache, meta, share, self.size, scale, k_scale, v_scale,
                                    logits_soft_cap)
        else:
            if not kv_written:
                mine = torch.nonzero(meta.slot_mapping >= 0).flatten()
                if mine.numel():
                    write_kv_cache(k.index_select(0, mine), v.index_select(0, mine), k_cache, v_cache,
                                   meta.slot_mapping.index_select(0, mine), k_scale, v_scale)
            out, lse = partial_paged_attention(q, k_cache, v_cache, meta, self.rank, self.size, scale, k_scale,
                                               v_scale, sliding_window, logits_soft_cap)
        gathered = self.exchange(torch.cat((out, lse.unsqueeze(-1)), dim=-1))  # [size, T, H, D + 1]
        head_dim = q.shape[-1]
        return merge_partials(gathered[..., :head_dim], gathered[..., head_dim]).to(q.dtype)
