"""An fp8 KV-cache attention case for kernel tests: every token of each sequence written through the torch
quantisation into shuffled blocks, and the expected output in float64 over the stored values times
the scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.support.paged_batch import shuffled_tables
from vllm_actors.kernels import kv_quant
from vllm_actors.kernels.attention import AttentionMetadata, build_attention_metadata, gather_kv, write_kv_cache


@dataclass
class Fp8Case:
    q: torch.Tensor
    k_cache: torch.Tensor  # every token written (quantised) already
    v_cache: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    meta: AttentionMetadata
    expected: torch.Tensor  # float64 [T, H, D]
    scale: float


def make_fp8_case(
    specs: list[tuple[int, int]], block_size: int, heads: tuple[int, int], head_dim: int, dtype: torch.dtype,
    cache_dtype: torch.dtype, seed: int, kv_scales: tuple[float, float] = (0.02, 0.01),
    device: torch.device | str = "cpu",
) -> Fp8Case:  # fmt: skip
    """specs: (cached_len, query_len) per sequence, all their tokens written through the torch
    quantisation; the expected output is float64 attention over the cache's values times the scales."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    num_blocks, tables = shuffled_tables(specs, block_size, gen, spare_blocks=2)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)  # garbage outside the sequences
    v_cache = torch.randn(shape, generator=gen).to(cache_dtype).to(device)
    k_scale, v_scale = kv_quant.kv_scale_tensors(torch.device(device), *kv_scales)
    lengths = [c + q for c, q in specs]
    every = build_attention_metadata(lengths, lengths, tables, block_size, device)
    k = (torch.randn(sum(lengths), num_kv_heads, head_dim, generator=gen) * 2).to(dtype).to(device)
    v = torch.randn(sum(lengths), num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    write_kv_cache(k, v, k_cache, v_cache, every.slot_mapping, k_scale, v_scale)
    qs = [torch.randn(q, num_heads, head_dim, generator=gen).to(dtype) for _, q in specs]
    scale = head_dim**-0.5
    group = num_heads // num_kv_heads
    expected = []
    for i, ((c, q_len), q) in enumerate(zip(specs, qs)):
        kd = (gather_kv(k_cache, every.block_tables[i], c + q_len).cpu().double() * k_scale.item())
        vd = (gather_kv(v_cache, every.block_tables[i], c + q_len).cpu().double() * v_scale.item())
        kd = kd.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        vd = vd.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q.double().transpose(0, 1) @ kd.transpose(1, 2) * scale
        visible = torch.arange(c + q_len).unsqueeze(0) <= torch.arange(c, c + q_len).unsqueeze(1)
        expected.append((torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ vd).transpose(0, 1))
    meta = build_attention_metadata([q for _, q in specs], lengths, tables, block_size, device)
    return Fp8Case(torch.cat(qs).to(device), k_cache, v_cache, k_scale, v_scale, meta, torch.cat(expected), scale)
