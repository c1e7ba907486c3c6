"""The torch._scaled_mm path of the FP8 GEMMs without a GPU: the activation scales written
column-major, the weight scales in each layout, and the probe against stand-ins for
``torch._scaled_mm`` and ``torch.nn.functional.scaled_mm`` (float64 math) that check the scales' shapes
and strides as torch's ScaledBlas.cpp does, or compute a wrong product (then no layout: the Triton
GEMM). On the CPU ``fp8_linear`` never takes the path."""

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
    assert all(fp8_scaled_mm.weight_scales(aligned, layout).data_ptr() == aligned.data_ptr() for layout in LAYOUTS)


def _blocks(size: int) -> int:
    return -(-size // 128)


def _torch_checks(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> None:
    """torch._scaled_mm's checks of the 1x128 x 128x128 recipe (ScaledBlas.cpp): scale_a [M, K/128] with
    strides (1, M); scale_b.t() [N/128, K/128] with strides (K/128, 1)."""
    rows, k = a.shape
    b_t = scale_b.t()
    if not (scale_a.shape == (rows, _blocks(k)) and scale_a.stride(0) == 1 and scale_a.stride(1) == rows
            and b_t.shape == (_blocks(b.shape[1]), _blocks(k)) and b_t.stride() == (_blocks(k), 1)):
        raise RuntimeError("Invalid scaling configuration.")


def _stand_in(wrong: bool = False, rows_multiple: int = 1) -> Any:
    """``torch._scaled_mm`` in float64 with torch's checks of the scales (and, where ``rows_multiple`` > 1,
    a library that wants M a multiple of it), or a wrong product."""
    def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
        _torch_checks(a, b, scale_a, scale_b)
        if a.shape[0] % rows_multiple:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        out = fp8_gemm.fp8_linear_reference(a, scale_a, b.t(), scale_b.t(), (128, 128))
        return (out * 2 if wrong else out).to(out_dtype)
    return scaled_mm


def _refused(*args: Any, **kwargs: Any) -> torch.Tensor:
    raise RuntimeError("Invalid scaling configuration")


@pytest.mark.parametrize("rows_multiple", [1, 4], ids=["any_rows", "rows_of_4"])
def test_probe_finds_the_layout_torch_takes(rows_multiple: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own stride checks: the weight scales transposed, unpadded, and M padded to 4 rows (tried first:
    the H200's cuBLASLt wanted it, and a library that takes any M takes it too); the explicit recipes refused
    here, as where torch lacks them."""
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(rows_multiple=rows_multiple), raising=False)
    if hasattr(torch.nn.functional, "scaled_mm"):
        monkeypatch.setattr(torch.nn.functional, "scaled_mm", _refused)
    monkeypatch.setattr(fp8_scaled_mm, "PROBE_SHAPE", (5, 512, 256))
    layout = fp8_scaled_mm._probe(torch.device("cpu"), _quantize)
    assert layout == ScaleLayout(True, True, False, pad_m=True)


def test_probe_refuses_a_wrong_product(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_scaled_mm", _stand_in(wrong=True), raising=False)
    if hasattr(torch.nn.functional, "scaled_mm"):
        monkeypatch.setattr(torch.nn.functional, "scaled_mm", _refused)
    monkeypatch.setattr(fp8_scaled_mm, "PROBE_SHAPE", (5, 512, 256))
    assert fp8_scaled_mm._probe(torch.device("cpu"), _quantize) is None


def test_takes_only_cuda_and_128_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.zeros(256, 512, dtype=fp8_gemm.FP8_DTYPE)
    x = torch.zeros(8, 512)
    assert not fp8_scaled_mm.takes(x, weight, (128, 128))  # the CPU: the Triton GEMM
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fp8_scaled_mm.takes(x, weight, (128, 128))
    assert not fp8_scaled_mm.takes(x, weight, (64, 64)) and not fp8_scaled_mm.takes(x, weight, None)
    assert not fp8_scaled_mm.takes(x, weight[:200], (128, 128))
    assert not fp8_scaled_mm.takes(x[:, :384], weight[:, :384], (128, 128))  # 3 K blocks: not a multiple of 4
    monkeypatch.setenv("VLLM_ACTORS_FP8_SCALED_MM", "0")
    assert not fp8_scaled_mm.takes(x, weight, (128, 128))


def _functional_stand_in() -> Any:
    """``torch.nn.functional.scaled_mm`` in float64 with torch's checks of the 1x128 x 128x128 recipes
    (scale_a [M, K/128] strides (1, M); scale_b [round_up(K/128, 4), N/128] strides (1, that)), and a
    library that wants M a multiple of 4."""
    functional = torch.nn.functional

    def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, recipe_a: Any, scale_b: torch.Tensor,
                  recipe_b: Any, output_dtype: torch.dtype) -> torch.Tensor:
        if (recipe_a, recipe_b) != (functional.ScalingType.BlockWise1x128, functional.ScalingType.BlockWise128x128):
            raise ValueError("Invalid scaling configuration.")
        rows, k = a.shape
        padded_k = -(-_blocks(k) // 4) * 4
        if not (scale_a.stride() == (1, rows) and scale_b.shape == (padded_k, _blocks(b.shape[1]))
                and scale_b.stride() == (1, padded_k)):
            raise ValueError("scale_b must have strides (1, round_up(K / 128, 4))")
        if rows % 4:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")
        return fp8_gemm.fp8_linear_reference(a, scale_a, b.t(), scale_b[:_blocks(k)].t(), (128, 128)).to(output_dtype)
    return scaled_mm


def test_probe_pads_the_rows_for_the_functional_recipes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where only the explicit recipes with M padded to 4 work (the unpadded layouts all refused), the
    probe finds them, and ``fp8_linear``'s path cuts the padded rows off again."""
    if not hasattr(torch.nn.functional, "ScalingType"):
        pytest.skip("this torch has no torch.nn.functional.scaled_mm")

    monkeypatch.setattr(torch, "_scaled_mm", _refused, raising=False)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", _functional_stand_in())
    monkeypatch.setattr(fp8_scaled_mm, "PROBE_SHAPE", (5, 512, 256))
    layout = fp8_scaled_mm._probe(torch.device("cpu"), _quantize)
    assert layout is not None and layout.functional and layout.pad_m
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((7, 512), generator=gen)
    weight, scale = fp8_gemm.quantize_weight(0.02 * torch.randn((384, 512), generator=gen), (128, 128))
    x_q, x_s = _quantize(fp8_scaled_mm.pad_rows(x, layout), True)
    assert x_q.shape[0] == 8 and fp8_scaled_mm.padded_rows(7, layout) == 8
    got = fp8_scaled_mm.scaled_mm(x_q, x_s, weight, scale, layout, None, torch.float32)[:7]
    want = fp8_gemm.fp8_linear_reference(x_q[:7], x_s[:7].contiguous(), weight, scale, (128, 128))
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
