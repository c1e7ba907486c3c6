"""The flash-attn split's merge in one Triton launch (``kernels/split_merge.py``, under TRITON_INTERPRET=1
here) against its torch form (``flash_attn_split.merge_into_torch``, run in float64): rows merged in place
at any offset, head dims that are not powers of two, ranges with no key (LSE -inf) and rows with none at
all, rows outside the split untouched."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels.flash_attn_split import KeySplits, merge_into_torch
from vllm_actors.kernels.split_merge import UNSPECIALISED, launch_scalars, merge_split_rows


def _case(total: int, q_start: int, q_len: int, splits: int, heads: int, dim: int, seed: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(total, heads, dim, generator=g)
    lse = torch.randn(heads, total, generator=g) * 4
    split_out = torch.randn(splits * q_len, heads, dim, generator=g)
    split_lse = torch.randn(heads, splits * q_len, generator=g) * 4
    plan = KeySplits(seq=0, q_start=q_start, q_len=q_len, seq_len=0, tail_block=0, blocks_per_split=0,
                     num_splits=splits)
    return out, lse, split_out, split_lse, plan


@pytest.mark.parametrize(("total", "q_start", "q_len", "splits", "dim"),
                         [(40, 5, 30, 3, 16), (9, 0, 9, 1, 24), (70, 60, 7, 6, 8), (120, 4, 3, 37, 16)])
def test_the_triton_merge_equals_the_torch_form(total: int, q_start: int, q_len: int, splits: int, dim: int) -> None:
    out, lse, split_out, split_lse, plan = _case(total, q_start, q_len, splits, 4, dim, seed=total)
    split_lse[1, 2] = float("-inf")  # a range without a key for one row
    lse[2, q_start + 1] = float("-inf")
    if splits > 1:
        split_lse[3, 1::q_len] = float("-inf")  # a row that sees no key at all: every part -inf
        lse[3, q_start + 1] = float("-inf")
    want = merge_into_torch(out.double(), lse.double(), plan, split_out.double(), split_lse.double())
    got = merge_split_rows(out.clone(), lse, q_start, q_len, splits, split_out, split_lse)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    outside = [r for r in range(total) if not q_start <= r < q_start + q_len]
    assert torch.equal(got[outside], out[outside])
    if splits > 1:
        assert torch.equal(got[q_start + 1, 3], torch.zeros(dim))


def test_a_bfloat16_output_is_merged_in_float32_and_rounded_once() -> None:
    out, lse, split_out, split_lse, plan = _case(12, 2, 8, 2, 2, 16, seed=7)
    out16, split16 = out.bfloat16(), split_out.bfloat16()
    want = merge_into_torch(out16.double(), lse.double(), plan, split16.double(), split_lse.double())
    got = merge_split_rows(out16.clone(), lse, 2, 8, 2, split16, split_lse)
    assert got.dtype == torch.bfloat16
    # one cast to bfloat16 of the float32 merge (within an ulp, up to 2**-7 relative: the interpreter truncates where
    # the GPU rounds), nothing accumulated in bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2**-7 + 1e-6, atol=1e-6)


def test_one_compiled_variant_serves_every_step() -> None:
    """What varies from one split step to the next (the chunk's rows and place, the split count, the step's
    rows in the LSE strides) is no constexpr and never specialised on: a variant compiled mid-serving for a
    new split count or stride divisibility held a 1M-token prefill's neighbours 180-380 ms on the H200."""
    steps = [_case(total, q_start, q_len, splits, 4, 64, seed=1) for total, q_start, q_len, splits in
             ((300, 0, 256, 5), (141, 20, 64, 17), (2200, 2048, 96, 64), (33, 1, 1, 1))]
    scalars = [launch_scalars(out, lse, plan.q_start, plan.q_len, plan.num_splits, split_out, split_lse)
               for out, lse, split_out, split_lse, plan in steps]
    varying = {name for name in scalars[0] if len({s[name] for s in scalars}) > 1}
    assert varying and varying <= set(UNSPECIALISED)  # the kernel's do_not_specialize
