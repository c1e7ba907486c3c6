"""Cases for the Triton paged-attention kernels: random batches on shuffled block tables with a
float64 torch reference, and the kernels' runners (the output poisoned with NaN first).

Without CUDA the kernels run in Triton's interpreter (exact but slow), so the CPU cases are small.
TRITON_INTERPRET must be set before the kernels are decorated, i.e. before
`vllm_actors.kernels.triton_attention` is imported: it only changes how Triton runs kernels. A test
module calls ``pytest.importorskip("triton")`` before importing this one."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.support.paged_batch import shuffled_tables  # noqa: E402
from vllm_actors.kernels import triton_attention as ta  # noqa: E402
from vllm_actors.kernels.attention import AttentionMetadata, build_attention_metadata, write_kv_cache  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and not ta.INTERPRET:  # imported elsewhere before TRITON_INTERPRET was set
    ta = importlib.reload(ta)
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

T = TypeVar("T")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    """The float32 reference paths must not use TF32 on a GPU."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # new tokens [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # the cached prefixes written, the new tokens not yet
    v_cache: torch.Tensor
    meta: AttentionMetadata
    expected: torch.Tensor  # float64 [T, H, D]
    scale: float


def make_case(
    specs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    spare_blocks: int = 3,
    num_blocks: int | None = None,
) -> Case:
    """specs: (cached_len, query_len) per sequence. Block tables are shuffled, the cache is random
    garbage outside the sequences' slots, and the expected output comes from dense float64 math."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables = shuffled_tables(specs, block_size, gen, spare_blocks, num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    full_k = [torch.randn(c + q, num_kv_heads, head_dim, generator=gen).to(dtype) for c, q in specs]
    full_v = [torch.randn(c + q, num_kv_heads, head_dim, generator=gen).to(dtype) for c, q in specs]
    qs = [torch.randn(q, num_heads, head_dim, generator=gen).to(dtype) for _, q in specs]
    prefix = build_attention_metadata([c for c, _ in specs], [c for c, _ in specs], tables, block_size)
    if prefix.num_tokens:
        write_kv_cache(
            torch.cat([k[:c] for k, (c, _) in zip(full_k, specs)]),
            torch.cat([v[:c] for v, (c, _) in zip(full_v, specs)]),
            k_cache,
            v_cache,
            prefix.slot_mapping,
        )
    scale = head_dim**-0.5
    group = num_heads // num_kv_heads
    expected = []
    for (c, q_len), q, k, v in zip(specs, qs, full_k, full_v):
        kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q.double().transpose(0, 1) @ kd.transpose(1, 2) * scale  # [H, q_len, S]
        visible = torch.arange(c + q_len).unsqueeze(0) <= torch.arange(c, c + q_len).unsqueeze(1)
        scores = scores.masked_fill(~visible, float("-inf"))
        expected.append((torch.softmax(scores, dim=-1) @ vd).transpose(0, 1))
    meta = build_attention_metadata([q for _, q in specs], [c + q for c, q in specs], tables, block_size, DEVICE)
    return Case(
        q=torch.cat(qs).to(DEVICE),
        k=torch.cat([k[c:] for k, (c, _) in zip(full_k, specs)]).to(DEVICE),
        v=torch.cat([v[c:] for v, (c, _) in zip(full_v, specs)]).to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        meta=meta,
        expected=torch.cat(expected),
        scale=scale,
    )


def assert_close(out: torch.Tensor, case: Case, dtype: torch.dtype) -> None:
    """Every element written and finite; per sequence ‖out − ref‖/‖ref‖ within the dtype's tolerance,
    and no single token row worse than 5x that."""
    got = out.double().cpu()
    assert torch.isfinite(got).all(), f"{(~torch.isfinite(got)).sum().item()} elements not written or not finite"
    tol = TOLERANCE[dtype]
    start = 0
    for i, q_len in enumerate(case.meta.query_lens_cpu):
        if q_len == 0:
            continue
        ref, part = case.expected[start : start + q_len], got[start : start + q_len]
        rel = ((part - ref).norm() / ref.norm()).item()
        assert rel < tol, f"sequence {i} (query_len {q_len}, seq_len {case.meta.seq_lens_cpu[i]}): rel err {rel:.2e}"
        row_rel = (part - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
        assert row_rel.max().item() < 5 * tol, f"sequence {i}: worst row rel err {row_rel.max().item():.2e}"
        start += q_len


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def write_new_tokens(case: Case) -> None:
    write_kv_cache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)


def run_varlen(case: Case) -> torch.Tensor:
    write_new_tokens(case)
    out = poisoned_like(case.q)
    m = case.meta
    ta.paged_attention_varlen(
        case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
        m.max_query_len, case.scale, out=out,
    )  # fmt: skip
    return out


def run_decode(case: Case, num_splits: int | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
    write_new_tokens(case)
    out = poisoned_like(case.q)
    m = case.meta
    ta.paged_attention_decode(
        case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
        m.max_seq_len, case.scale, out=out, num_splits=num_splits, order=order,
    )  # fmt: skip
    return out


def captured(step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``step`` run once on a side stream (compiled outside the capture), then captured in a CUDA graph;
    the graph and what the captured call returned (its static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = step()
    return graph, output
