"""The kernel microbenchmark's attention cases (``benchmarks.lib.kernel_micro``): decode, prefill and
a chunked-prefill step, the Triton paged-attention kernels against torch references."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from benchmarks.lib.kernels_timing import DTYPES, do_bench, do_bench_graph, spin_up

if TYPE_CHECKING:
    from vllm_actors.kernels.attention import AttentionMetadata


@dataclass
class Row:
    kind: str  # "decode" | "prefill" | "mixed"
    batch: int
    context: int  # keys per sequence (the longest, for mixed)
    query_len: int  # new tokens per sequence (the longest, for mixed)
    num_splits: int | None
    rel_err: float
    ms: dict[str, float]  # timings by name; "triton" is the kernel under test
    metric: float  # GB/s (decode) or TFLOP/s (prefill) of the Triton kernel
    metric_unit: str
    notes: dict[str, float] = field(default_factory=dict)


@dataclass
class Setup:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    tables: list[list[int]]


def _setup(
    query_lens: list[int],
    seq_lens: list[int],
    args: argparse.Namespace,
    device: torch.device,
    seed: int,
) -> Setup:
    """Random caches and tokens; every sequence's blocks scattered over the cache by a permutation.
    The new tokens' k/v are already written (as the backend does before attending)."""
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import build_attention_metadata

    dtype = DTYPES[args.dtype]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    need = [math.ceil(n / args.block_size) for n in seq_lens]
    num_blocks = sum(need) + 8
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables: list[list[int]] = []
    for n in need:
        tables.append(perm[:n])
        perm = perm[n:]
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    tokens = sum(query_lens)
    s = Setup(
        q=torch.randn(tokens, args.num_heads, args.head_dim, device=device, dtype=dtype),
        k=torch.randn(tokens, args.num_kv_heads, args.head_dim, device=device, dtype=dtype),
        v=torch.randn(tokens, args.num_kv_heads, args.head_dim, device=device, dtype=dtype),
        k_cache=torch.randn(shape, device=device, dtype=dtype),
        v_cache=torch.randn(shape, device=device, dtype=dtype),
        meta=build_attention_metadata(query_lens, seq_lens, tables, args.block_size, device),
        tables=tables,
    )
    ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, s.meta.slot_mapping)
    return s


def _gather(cache: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, context, D] read through the block tables [B, blocks] (every sequence `context` long)."""
    batch = tables.shape[0]
    blocks = cache.index_select(0, tables.flatten())
    return blocks.view(batch, -1, cache.shape[2], cache.shape[3])[:, :context].transpose(1, 2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def _reference(s: Setup, scale: float) -> torch.Tensor:
    """float32 paged attention through the torch reference (its KV write is an idempotent rewrite)."""
    from vllm_actors.kernels.attention import TorchPagedAttention

    return TorchPagedAttention().forward(
        s.q.float(), s.k.float(), s.v.float(), s.k_cache.float(), s.v_cache.float(), s.meta, scale
    )


def bench_decode(
    batch: int, context: int, args: argparse.Namespace, device: torch.device, splits: int | None = None
) -> Row:
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import TorchPagedAttention

    s = _setup([1] * batch, [context] * batch, args, device, seed=batch * 7919 + context)
    meta = s.meta
    scale = args.head_dim**-0.5
    num_splits = splits or ta.choose_decode_splits(batch, args.num_kv_heads, context, device)
    out = torch.empty_like(s.q)

    def triton_step() -> torch.Tensor:
        return ta.paged_attention_decode(
            s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_seq_len, scale, out=out, num_splits=num_splits,
        )  # fmt: skip

    tables = torch.tensor(s.tables, dtype=torch.long, device=device)
    q4 = s.q.unsqueeze(2)  # [B, H, 1, D]

    def gather_sdpa() -> torch.Tensor:
        return _sdpa(q4, _gather(s.k_cache, tables, context), _gather(s.v_cache, tables, context), scale, False)

    k_dense = _gather(s.k_cache, tables, context).contiguous()
    v_dense = _gather(s.v_cache, tables, context).contiguous()
    rel = _rel_err(triton_step(), _reference(s, scale))

    spin_up()
    ms = {
        "triton": do_bench(triton_step, args),
        "triton_graph": do_bench_graph(triton_step, args),
        "gather_sdpa": do_bench(gather_sdpa, args),
        "gather_sdpa_graph": do_bench_graph(gather_sdpa, args),
        "sdpa_only": do_bench(lambda: _sdpa(q4, k_dense, v_dense, scale, False), args),
        "kv_write": do_bench(lambda: ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, meta.slot_mapping), args),
    }
    if batch <= args.torch_backend_max_batch:
        backend = TorchPagedAttention()
        ms["torch_loop"] = do_bench(lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, meta, scale), args)
    kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * s.k_cache.element_size()
    return Row(
        kind="decode",
        batch=batch,
        context=context,
        query_len=1,
        num_splits=num_splits,
        rel_err=rel,
        ms=ms,
        metric=kv_bytes / (ms["triton_graph"] * 1e-3) / 1e9,
        metric_unit="GB/s",
        notes={"kv_bytes": kv_bytes, "sdpa_only_GBps": kv_bytes / (ms["sdpa_only"] * 1e-3) / 1e9},
    )


def bench_prefill(batch: int, length: int, args: argparse.Namespace, device: torch.device) -> Row:
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import TorchPagedAttention

    s = _setup([length] * batch, [length] * batch, args, device, seed=batch + length)
    meta = s.meta
    scale = args.head_dim**-0.5

    def triton_step() -> torch.Tensor:
        return ta.paged_attention_varlen(
            s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        )  # fmt: skip

    tables = torch.tensor(s.tables, dtype=torch.long, device=device)
    q4 = s.q.view(batch, length, args.num_heads, args.head_dim).transpose(1, 2)

    def gather_sdpa() -> torch.Tensor:
        return _sdpa(q4, _gather(s.k_cache, tables, length), _gather(s.v_cache, tables, length), scale, True)

    k_dense = _gather(s.k_cache, tables, length).contiguous()
    v_dense = _gather(s.v_cache, tables, length).contiguous()
    rel = _rel_err(triton_step(), _reference(s, scale))

    backend = TorchPagedAttention()
    spin_up()
    ms = {
        "triton": do_bench(triton_step, args),
        "gather_sdpa": do_bench(gather_sdpa, args),
        "sdpa_only": do_bench(lambda: _sdpa(q4, k_dense, v_dense, scale, True), args),
        "torch_loop": do_bench(lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, meta, scale), args),
        "kv_write": do_bench(lambda: ta.write_kv_cache_triton(s.k, s.v, s.k_cache, s.v_cache, meta.slot_mapping), args),
    }
    flops = 4 * batch * args.num_heads * args.head_dim * length * (length + 1) / 2
    return Row(
        kind="prefill",
        batch=batch,
        context=length,
        query_len=length,
        num_splits=None,
        rel_err=rel,
        ms=ms,
        metric=flops / (ms["triton"] * 1e-3) / 1e12,
        metric_unit="TFLOP/s",
        notes={"flops": flops, "sdpa_only_TFLOPs": flops / (ms["sdpa_only"] * 1e-3) / 1e12},
    )


def bench_mixed(args: argparse.Namespace, device: torch.device) -> Row:
    """A chunked-prefill step: a 512-token chunk on a 1536-token prefix beside 63 decodes at 2048."""
    from vllm_actors.kernels import triton_attention as ta
    from vllm_actors.kernels.attention import TorchPagedAttention

    query_lens = [512] + [1] * 63
    seq_lens = [2048] * 64
    s = _setup(query_lens, seq_lens, args, device, seed=64)
    meta = s.meta
    scale = args.head_dim**-0.5

    def triton_step() -> torch.Tensor:
        return ta.paged_attention_varlen(
            s.q, s.k_cache, s.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            meta.max_query_len, scale,
        )  # fmt: skip

    rel = _rel_err(triton_step(), _reference(s, scale))
    backend = TorchPagedAttention()
    spin_up()
    ms = {
        "triton": do_bench(triton_step, args),
        "torch_loop": do_bench(lambda: backend.forward(s.q, s.k, s.v, s.k_cache, s.v_cache, meta, scale), args),
    }
    kv_bytes = 2 * sum(seq_lens) * args.num_kv_heads * args.head_dim * s.k_cache.element_size()
    return Row(
        kind="mixed",
        batch=len(query_lens),
        context=max(seq_lens),
        query_len=max(query_lens),
        num_splits=None,
        rel_err=rel,
        ms=ms,
        metric=kv_bytes / (ms["triton"] * 1e-3) / 1e9,
        metric_unit="GB/s",
        notes={"kv_bytes": kv_bytes},
    )
