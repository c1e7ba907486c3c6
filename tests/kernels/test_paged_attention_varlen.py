"""The Triton varlen paged-attention kernel (prefill, chunked prefill, mixed batches) against a
float64 torch reference, on small shapes (Triton's interpreter without CUDA)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.support.paged_attention_case import (  # noqa: E402
    DEVICE,
    _exact_fp32_matmuls,  # noqa: F401 (autouse: float32 references without TF32)
    assert_close,
    make_case,
    run_varlen,
)


@pytest.mark.parametrize("length_kind", ["one", "block", "block_plus_one", "long"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_varlen_single_prefill(block_size: int, length_kind: str) -> None:
    length = {"one": 1, "block": block_size, "block_plus_one": block_size + 1, "long": 200}[length_kind]
    case = make_case([(0, length)], block_size, 4, 2, 32, torch.float32, seed=length + block_size)
    assert_close(run_varlen(case), case, torch.float32)


@pytest.mark.parametrize("cached,new", [(7, 5), (16, 17), (15, 2), (31, 33), (150, 40)])
def test_varlen_cached_prefix_plus_chunk(cached: int, new: int) -> None:
    case = make_case([(cached, new)], 16, 6, 2, 32, torch.float32, seed=cached * 100 + new)
    assert_close(run_varlen(case), case, torch.float32)


MIXED = [(0, 1), (0, 16), (19, 1), (5, 17), (32, 7), (40, 1), (0, 33), (16, 0)]


@pytest.mark.parametrize(
    "dtype,heads,head_dim,block_size",
    [
        (torch.float32, (4, 4), 32, 16),  # group 1
        (torch.bfloat16, (4, 2), 32, 16),  # group 2
        (torch.float16, (9, 3), 64, 32),  # group 3 (padded to 4), SmolLM2's head shape
    ],
)
def test_varlen_mixed_prefill_decode(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int, block_size: int
) -> None:
    case = make_case(MIXED, block_size, heads[0], heads[1], head_dim, dtype, seed=heads[0] + block_size)
    assert_close(run_varlen(case), case, dtype)


def test_varlen_head_dim_128() -> None:
    case = make_case([(20, 13), (0, 1)], 16, 2, 1, 128, torch.bfloat16, seed=12)
    assert_close(run_varlen(case), case, torch.bfloat16)


def test_varlen_strided_query() -> None:
    """q as a view into a fused qkv projection (row stride wider than heads x head_dim)."""
    case = make_case([(3, 20), (0, 9)], 16, 4, 2, 32, torch.float32, seed=11)
    wide = torch.randn(case.q.shape[0], 8, 32, device=DEVICE)
    wide[:, :4] = case.q
    case.q = wide[:, :4]
    assert not case.q.is_contiguous()
    assert_close(run_varlen(case), case, torch.float32)

