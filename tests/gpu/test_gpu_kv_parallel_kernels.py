"""On one GPU: a KV-parallel rank's partial attention on the compiled kernels (bf16, GQA 32/8,
head_dim 128, blocks of 16) against the float64 torch reference, output and log-sum-exp, for every
rank of 2 and 4 over long decodes, chunks over cached prefixes and a sequence a rank holds nothing
of; the decode replayed from a CUDA graph with other lengths; the flash-attn 4 past + Triton chunk
split where flash-attn 4 runs (Hopper).

Skipped without CUDA; ``pytest -m gpu tests/gpu/test_gpu_kv_parallel_kernels.py``.
"""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels.attention import AttentionMetadata, build_attention_metadata
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill, flash_attn_unavailable
from vllm_actors.kernels.kv_parallel import partial_paged_attention
from vllm_actors.kernels.kv_parallel_gpu import GpuPartialAttention
from vllm_actors.kernels.kv_parallel_share import rank_share

CUDA = torch.device("cuda")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
BLOCK, HEADS, KV_HEADS, DIM = 16, 32, 8, 128
SCALE = DIM**-0.5


def _case(query_lens: list[int], seq_lens: list[int], size: int,
          seed: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Interleaved tables (block j of a sequence on rank j % size), bf16 caches over every rank."""
    needed = [(n + BLOCK - 1) // BLOCK for n in seq_lens]
    per_rank = sum(needed)
    used = [0] * size
    tables = []
    for count in needed:
        table = []
        for j in range(count):
            rank = j % size
            table.append(used[rank] * size + rank)
            used[rank] += 1
        tables.append(table)
    meta = build_attention_metadata(query_lens, seq_lens, tables, BLOCK, device=CUDA)
    generator = torch.Generator(device=CUDA).manual_seed(seed)
    shape = (size * per_rank, BLOCK, KV_HEADS, DIM)
    k_cache = torch.randn(shape, generator=generator, device=CUDA).bfloat16()
    v_cache = torch.randn(shape, generator=generator, device=CUDA).bfloat16()
    q = torch.randn(sum(query_lens), HEADS, DIM, generator=generator, device=CUDA).bfloat16()
    return meta, q, k_cache, v_cache


def _check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    out, lse = got
    assert torch.equal(torch.isinf(lse), torch.isinf(want[1]))
    seen = torch.isfinite(want[1])
    assert (out[~seen] == 0).all()
    torch.testing.assert_close(lse[seen].double(), want[1][seen], rtol=0, atol=2e-2)
    error = (out.double() - want[0]).norm() / want[0].norm()
    assert error < 1e-2, f"relative error {error:.2e}"


def _each_rank(meta: AttentionMetadata, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, size: int,
               kernels: GpuPartialAttention) -> None:
    for rank in range(size):
        local_k, local_v = k_cache[rank::size].contiguous(), v_cache[rank::size].contiguous()
        got = kernels(q, local_k, local_v, meta, rank_share(meta, rank, size, BLOCK), size, SCALE)
        want = partial_paged_attention(q.double(), local_k.double(), local_v.double(), meta, rank, size, SCALE)
        _check(got, want)


@pytest.mark.parametrize("size", [2, 4])
def test_decode_partials_on_the_gpu(size: int) -> None:
    seq_lens = [5000, 17, 1, 300]
    _each_rank(*_case([1] * 4, seq_lens, size, seed=size), size=size, kernels=GpuPartialAttention())


@pytest.mark.parametrize("size", [2, 4])
def test_chunk_partials_on_the_gpu(size: int) -> None:
    query_lens, seq_lens = [517, 1000, 1, 16], [3517, 1000, 130, 93]
    _each_rank(*_case(query_lens, seq_lens, size, seed=10 + size), size=size, kernels=GpuPartialAttention())


def test_decode_partials_replayed_from_a_cuda_graph() -> None:
    size, rank = 2, 1
    meta, q, k_cache, v_cache = _case([1] * 3, [4000, 700, 40], size, seed=3)
    local_k, local_v = k_cache[rank::size].contiguous(), v_cache[rank::size].contiguous()
    kernels = GpuPartialAttention()
    captured = dict(meta.__dict__, max_seq_len=8192)  # a capture-time bound, as the runner's graphs
    graph_meta = AttentionMetadata(**captured)
    for _ in range(2):  # compile outside the graph
        kernels(q, local_k, local_v, graph_meta, rank_share(graph_meta, rank, size, BLOCK), size, SCALE)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = kernels(q, local_k, local_v, graph_meta, rank_share(graph_meta, rank, size, BLOCK), size, SCALE)
    graph_meta.seq_lens.copy_(torch.tensor([3000, 33, 1], dtype=torch.int32, device=CUDA))  # shorter: same tables
    graph.replay()
    replayed = AttentionMetadata(**dict(captured, seq_lens_cpu=[3000, 33, 1]))
    _check((out, lse), partial_paged_attention(q.double(), local_k.double(), local_v.double(), replayed, rank, size,
                                               SCALE))


@pytest.mark.skipif(torch.cuda.is_available() and flash_attn_unavailable(CUDA) is not None,
                    reason="needs flash-attn 4 on a Hopper GPU")
@pytest.mark.parametrize("size", [2, 4])
def test_flash_attn_past_and_triton_chunk_on_the_gpu(size: int) -> None:
    query_lens, seq_lens = [2048, 2100, 1], [6000, 2100, 77]  # the second: no past
    kernels = GpuPartialAttention(prefill=FlashAttnPrefill("flash_attn"))
    meta, q, k_cache, v_cache = _case(query_lens, seq_lens, size, seed=20 + size)
    assert kernels.prefill is not None and kernels.prefill.wants(q, k_cache, v_cache, meta)
    _each_rank(meta, q, k_cache, v_cache, size, kernels)
