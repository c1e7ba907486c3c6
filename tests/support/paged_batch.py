"""A paged-attention step for kernel tests: random caches with each sequence's cached prefix written
through shuffled block tables, the step's new q/k/v, its metadata, and the torch reference's output.
Also a torch model of flash-attn's varlen forward over a page table (the tests' stand-in for it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vllm_actors.kernels.attention import (
    AttentionMetadata,
    TorchPagedAttention,
    build_attention_metadata,
    write_kv_cache,
)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # the new tokens' k/v [T, Hkv, D], not yet in the cache
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float

    def reference(self) -> torch.Tensor:
        """The torch reference backend in float32 on copies of the caches (new tokens written there)."""
        return TorchPagedAttention().forward(
            self.q.float(), self.k.float(), self.v.float(), self.k_cache.float(), self.v_cache.float(), self.meta,
            self.scale,
        )  # fmt: skip

    def write_new_tokens(self) -> None:
        write_kv_cache(self.k, self.v, self.k_cache, self.v_cache, self.meta.slot_mapping)


def shuffled_tables(
    specs: list[tuple[int, int]], block_size: int, gen: torch.Generator, spare_blocks: int = 3,
    num_blocks: int | None = None,
) -> tuple[int, list[list[int]]]:
    """The pool size (the blocks the sequences need plus ``spare_blocks``, unless ``num_blocks``) and
    each sequence's blocks, drawn from one random permutation of the pool (specs: (cached_len,
    query_len) per sequence), so tables are out of order and interleaved."""
    need = [-(-(cached + new) // block_size) for cached, new in specs]
    num_blocks = num_blocks or sum(need) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for n in need:
        tables.append(perm[:n])
        perm = perm[n:]
    return num_blocks, tables


def paged_batch(
    specs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """specs: (cached_len, query_len) per sequence. Blocks outside the sequences hold random values."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables = shuffled_tables(specs, block_size, gen)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = rand(*shape), rand(*shape)
    prefix = build_attention_metadata([c for c, _ in specs], [c for c, _ in specs], tables, block_size, device)
    cached = prefix.num_tokens
    write_kv_cache(rand(cached, num_kv_heads, head_dim), rand(cached, num_kv_heads, head_dim), k_cache, v_cache,
                   prefix.slot_mapping)
    tokens = sum(new for _, new in specs)
    return PagedBatch(
        q=rand(tokens, num_heads, head_dim),
        k=rand(tokens, num_kv_heads, head_dim),
        v=rand(tokens, num_kv_heads, head_dim),
        k_cache=k_cache,
        v_cache=v_cache,
        meta=build_attention_metadata([n for _, n in specs], [c + n for c, n in specs], tables, block_size, device),
        scale=head_dim**-0.5,
    )


def flash_attn_varlen_model(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqused_k: torch.Tensor,
    page_table: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int | None, int | None] = (None, None),
    softcap: float = 0.0,
    pack_gqa: bool | None = None,  # how the kernel tiles grouped heads: the same result either way
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """flash_attn_varlen_func's documented semantics for paged K/V, in float32: sequence b's queries are
    q[cu_seqlens_q[b]:cu_seqlens_q[b+1]], its keys the first seqused_k[b] rows of its pages
    (page_table[b]) of k/v [num_pages, page_size, Hkv, D]; causal is aligned bottom-right;
    window_size[0] = L keeps the L keys before each query's position (and its own); softcap c
    replaces each scaled score s by c * tanh(s / c). ``return_lse``: also each query's log-sum-exp of
    its scaled scores, [num_heads, total_q] (-inf for a query without keys)."""
    page_size = k.shape[1]
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
    group = q.shape[1] // k.shape[2]
    for b in range(page_table.shape[0]):
        start, end, k_len = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        if end == start:
            continue
        pages = page_table[b, : -(-k_len // page_size)].long()
        keys = k[pages].reshape(-1, *k.shape[2:])[:k_len].float().repeat_interleave(group, 1).transpose(0, 1)
        values = v[pages].reshape(-1, *v.shape[2:])[:k_len].float().repeat_interleave(group, 1).transpose(0, 1)
        positions = torch.arange(end - start).unsqueeze(1) + (k_len - (end - start))
        key_positions = torch.arange(k_len).unsqueeze(0)
        mask = key_positions <= positions if causal else None
        if window_size[0] is not None and mask is not None:
            mask &= key_positions >= positions - window_size[0]
        queries = q[start:end].float().transpose(0, 1)
        if softcap or return_lse:
            scores = queries @ keys.transpose(1, 2) * softmax_scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf"))
            attended = torch.softmax(scores, dim=-1) @ values
            lse[:, start:end] = torch.logsumexp(scores, dim=-1)
        else:
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=softmax_scale)
        out[start:end] = attended.transpose(0, 1).to(q.dtype)
    return out, (lse if return_lse else None)


class VarlenRecorder:
    """flash_attn_varlen_func at the boundary: records each call and answers with the torch model."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls.append(kwargs)
        return flash_attn_varlen_model(**kwargs)
