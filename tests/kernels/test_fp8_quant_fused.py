"""The FP8 activation quantization fused into RMSNorm and SiLU(gate) * up (the interpreter): x_q and
x_s bit-identical to the unfused path's (the producer's Triton kernel, then ``quantize_activations``,
in the Triton GEMM's layout and in cuBLASLt's padded, column-major one), near the float64 reference,
and the projection through them equal to ``fp8_linear``'s."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels import fp8_gemm, fused_ops
from vllm_actors.kernels.fp8_quant_fused import rms_norm_quant, silu_mul_quant
from vllm_actors.kernels.fp8_scaled_mm import ScaleLayout, pad_rows

pytest.importorskip("triton")

CUBLAS = ScaleLayout(True, True, False, pad_m=True)  # rows padded to 4, scales column-major
# (rows, K, group): odd rows; K a multiple of the group, not one, and one group a row
CASES = [(5, 128, 32), (3, 80, 32), (2, 48, 64)]


@pytest.fixture(autouse=True)
def _triton_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "triton")  # the unfused path's producers: their Triton kernels


def _unfused(x: torch.Tensor, group: int, layout: ScaleLayout | None) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_gemm.quantize_activations(pad_rows(x, layout) if layout else x, group,
                                         column_major=layout is not None)


def _assert_same(got: fp8_gemm.QuantizedActivations, want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got.x_q.view(torch.uint8), want[0].view(torch.uint8))
    assert torch.equal(got.x_s, want[1]) and got.x_s.stride() == want[1].stride()


def _near_reference(got: fp8_gemm.QuantizedActivations, exact: torch.Tensor, group: int) -> None:
    """Dequantized within e4m3's half step (2^-4 relative) of the float64 value, the scales amax / 448."""
    rows = exact.shape[0]
    x_q, x_s = got.x_q[:rows].double(), got.x_s[:rows].double()
    scales = x_s.repeat_interleave(group, 1)[:, : exact.shape[1]] if group < exact.shape[1] else x_s
    assert ((x_q * scales - exact).abs() <= exact.abs() / 16 + 1e-3).all()
    assert (got.x_q[rows:].float() == 0).all()  # padding rows: zeros


@pytest.mark.parametrize("layout", [None, CUBLAS], ids=["triton", "cublas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter mis-multiplies bfloat16
@pytest.mark.parametrize(("rows", "k", "group"), CASES)
def test_rms_norm_quant_equals_unfused(rows: int, k: int, group: int, dtype: torch.dtype,
                                       layout: ScaleLayout | None) -> None:
    gen = torch.Generator().manual_seed(rows * k)
    x, residual = (torch.randn((rows, k), generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.2 * torch.randn(k, generator=gen)).to(dtype)
    for res in (None, residual):
        normed, new_residual = fused_ops.rms_norm(x, weight, 1e-6, res)
        got, got_residual = rms_norm_quant(x, weight, 1e-6, res, group, layout)
        _assert_same(got, _unfused(normed, group, layout))
        assert torch.equal(got_residual, new_residual) and got.rows == rows and got.dtype == dtype
        summed = x.double() + (res.double() if res is not None else 0)
        exact = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
        _near_reference(got, exact, group)


@pytest.mark.parametrize("layout", [None, CUBLAS], ids=["triton", "cublas"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter mis-multiplies bfloat16
@pytest.mark.parametrize(("rows", "k", "group"), CASES)
def test_silu_mul_quant_equals_unfused(rows: int, k: int, group: int, dtype: torch.dtype,
                                       layout: ScaleLayout | None) -> None:
    gate_up = (2 * torch.randn((rows, 2 * k), generator=torch.Generator().manual_seed(k))).to(dtype)
    got = silu_mul_quant(gate_up, group, layout)
    _assert_same(got, _unfused(fused_ops.silu_and_mul(gate_up), group, layout))
    gate, up = gate_up.double().chunk(2, dim=-1)
    _near_reference(got, torch.nn.functional.silu(gate) * up, group)


def test_projection_through_fused_input_equals_fp8_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton GEMM (5 rows) and its one-row GEMV on the fused x_q and x_s give ``fp8_linear``'s output."""
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMV_ROWS", "0")  # one row: the W8A8 GEMV, whose input is quantized
    gen = torch.Generator().manual_seed(1)
    weight, scale = fp8_gemm.quantize_weight(0.05 * torch.randn((48, 64), generator=gen), (16, 16))
    norm_weight = 1 + 0.1 * torch.randn(64, generator=gen)
    for rows in (5, 1):
        x = torch.randn((rows, 64), generator=gen)
        plan = fp8_gemm.gemm_plan(x, weight, scale, (16, 16))
        assert not plan.gemv and plan.layout is None
        fused, _ = rms_norm_quant(x, norm_weight, 1e-6, None, 16, plan.layout)
        got = fp8_gemm.fp8_linear_quantized(fused, weight, scale, (16, 16))
        want = fp8_gemm.fp8_linear(fused_ops.rms_norm(x, norm_weight, 1e-6)[0], weight, scale, (16, 16))
        assert torch.equal(got, want)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="power of two"):
        silu_mul_quant(torch.zeros((2, 192)), 48, None)
    with pytest.raises(ValueError, match="unit column stride"):
        rms_norm_quant(torch.zeros((64, 2)).t(), torch.ones(64), 1e-6, None, 16, None)
