"""The torch._scaled_mm path of the FP8 GEMMs without a GPU: the activation scales written
column-major, the weight scales in each layout, and the probe against a stand-in for
``torch._scaled_mm`` (float64 math) that takes one layout and refuses the others, or computes a
wrong product (then no layout: the Triton GEMM). On the CPU ``fp8_linear`` never takes the path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vllm_actors.kernels import fp8_gemm, fp8_scaled_mm
from vllm_actors.kernels.fp8_scaled_mm import LAYOUTS, ScaleLayout

pytestmark = pytest.mark.skipif(not fp8_gemm.HAVE_TRITON, reason="needs triton")


def _quantize(x: torch.Tensor, column: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_gemm.quantize_activations(x, 128, column)


def test_column_major_activation_scales() -> None:
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(0)) * 3
    q, s = fp8_gemm.quantize_activations(x, 64)
    q_col, s_col = fp8_gemm.quantize_activations(x, 64, column_major=True)
    assert s_col.stride() == (1, 5) and s_col.shape == s.shape == (5, 5)
    assert torch.equal(s_col, s) and torch.equal(q_col.float(), q.float())


def test_weight_scales_in_each_layout() -> None:
    scale = torch.arange(3 * 6, dtype=torch.float32).reshape(3, 6)  # [N/128, K/128]: 6 K blocks, padded to 8
    for layout in LAYOUTS:
        got = fp8_scaled_mm.weight_scales(scale, layout)
        padded_k = 8 if layout.b_pad_k else 6
        assert got.shape == (padded_k, 3)
        assert got.stride() == ((1, padded_k) if layout.b_column_major else (3, 1))
        assert torch.equal(got[:6], scale.t()) and not got[6:].any()
    aligned = torch.ones(2, 8)
    assert fp8_scaled_mm.weight_scales(aligned, LAYOUTS[0]).data_ptr() == aligned.data_ptr()  # a view


def _stand_in(takes: ScaleLayout, wrong: bool = False) -> Any:
    """``torch._scaled_mm`` in float64 that refuses scale layouts other than ``takes``'s."""
    def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
        a_column = scale_a.stride(0) == 1 and scale_a.shape[1] > 1
        b_column = scale_b.stride(0) == 1
        if (a_column, b_column) != (takes.a_column_major, takes.b_column_major):
            raise RuntimeError("scale_a must have strides (1, M)")  # as torch words its refusals
        if takes.b_pad_k != (scale_b.shape[0] % 4 == 0 and scale_b.shape[0] > -(-a.shape[1] // 128)):
            raise ValueError("scale_b must have shape round_up(K / 128, 4) x N / 128")
        blocks_k = -(-a.shape[1] // 128)
        out = fp8_gemm.fp8_linear_reference(a, scale_a, b.t(), scale_b[:blocks_k].t(), (128, 128))
        return (out * 2 if wrong else out).to(out_dtype)
    return scaled_mm


@pytest.mark.parametrize("takes", [LAYOUTS[2], LAYOUTS[3]], ids=["a_rows_b_columns", "row_major"])
def test_probe_finds_the_layout_torch_takes(takes: ScaleLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(takes), raising=False)
    monkeypatch.setattr(fp8_scaled_mm, "PROBE_SHAPE", (5, 384, 256))  # 3 K blocks: padding tells layouts apart
    assert fp8_scaled_mm._probe(torch.device("cpu"), _quantize) == takes


def test_probe_refuses_a_wrong_product(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(LAYOUTS[1], wrong=True), raising=False)
    monkeypatch.setattr(fp8_scaled_mm, "PROBE_SHAPE", (5, 256, 256))
    assert fp8_scaled_mm._probe(torch.device("cpu"), _quantize) is None


def test_takes_only_cuda_and_128_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.zeros(256, 256, dtype=fp8_gemm.FP8_DTYPE)
    x = torch.zeros(8, 256)
    assert not fp8_scaled_mm.takes(x, weight, (128, 128))  # the CPU: the Triton GEMM
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fp8_scaled_mm.takes(x, weight, (128, 128))
    assert not fp8_scaled_mm.takes(x, weight, (64, 64)) and not fp8_scaled_mm.takes(x, weight, None)
    assert not fp8_scaled_mm.takes(x, weight[:200], (128, 128))
    monkeypatch.setenv("VLLM_ACTORS_FP8_SCALED_MM", "0")
    assert not fp8_scaled_mm.takes(x, weight, (128, 128))


def _functional_stand_in() -> Any:
    """``torch.nn.functional.scaled_mm`` in float64 that takes the 1x128 x 128x128 recipes only, with M a
    multiple of 4 (the scales' leading dimension in 16 bytes), as cuBLASLt on Hopper asks."""
    functional = torch.nn.functional

    def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, recipe_a: Any, scale_b: torch.Tensor,
                  recipe_b: Any, output_dtype: torch.dtype) -> torch.Tensor:
        if (recipe_a, recipe_b) != (functional.ScalingType.BlockWise1x128, functional.ScalingType.BlockWise128x128):
            raise ValueError("Invalid scaling configuration.")
        if a.shape[0] % 4 or scale_a.stride(0) != 1 or scale_b.stride(0) != 1 or scale_b.shape[0] % 4:
            raise RuntimeError("scale_a must have M a multiple of 4 and strides (1, M)")
        blocks_k = -(-a.shape[1] // 128)
        return fp8_gemm.fp8_linear_reference(a, scale_a, b.t(), scale_b[:blocks_k].t(), (128, 128)).to(output_dtype)
    return scaled_mm


def test_probe_pads_the_rows_for_the_functional_recipes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where only the explicit recipes with M padded to 4 work (the unpadded layouts all refused), the
    probe finds them, and ``fp8_linear``'s path cuts the padded rows off again."""
    if not hasattr(torch.nn.functional, "ScalingType"):
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")

    def refused(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("Invalid scaling configuration")

    monkeypatch.setattr(torch, "_scaled_mm", refused, raising=False)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", _functional_stand_in())
    monkeypatch.setattr(fp8_scaled_mm, "PROBE_SHAPE", (5, 256, 256))
    layout = fp8_scaled_mm._probe(torch.device("cpu"), _quantize)
    assert layout is not None and layout.functional and layout.pad_m
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((7, 256), generator=gen)
    weight, scale = fp8_gemm.quantize_weight(0.02 * torch.randn((384, 256), generator=gen), (128, 128))
    x_q, x_s = _quantize(fp8_scaled_mm.pad_rows(x, layout), True)
    assert x_q.shape[0] == 8 and fp8_scaled_mm.padded_rows(7, layout) == 8
    got = fp8_scaled_mm.scaled_mm(x_q, x_s, weight, scale, layout, None, torch.float32)[:7]
    want = fp8_gemm.fp8_linear_reference(x_q[:7], x_s[:7].contiguous(), weight, scale, (128, 128))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
