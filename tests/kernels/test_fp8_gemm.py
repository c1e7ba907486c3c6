"""The FP8 weight GEMMs against torch (float64, Triton's interpreter on the CPU): the per-token-group
activation quantization, the block-scaled and per-channel GEMM and the one-row GEMV, on small
shapes with partial blocks; and the torch quantize/dequantize pair."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels import fp8_gemm
from vllm_actors.kernels.fp8_gemm import FP8_MAX, fp8_linear_reference, quantize_weight

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fp8_gemm.HAVE_TRITON, reason="needs triton")


def _weight(n: int, k: int, block: tuple[int, int] | None, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen)  # rows of unlike ranges
    w, s = quantize_weight(weight, block)
    return w.to(DEVICE), s.to(DEVICE)


def test_quantize_and_dequantize_weights() -> None:
    weight = torch.randn(40, 48, generator=torch.Generator().manual_seed(0))
    for block in ((16, 16), (32, 32), None):
        w, s = quantize_weight(weight, block)
        rows = -(-40 // block[0]) if block else 40
        assert w.dtype == torch.float8_e4m3fn and s.shape == (rows, -(-48 // block[1]) if block else 1)
        back = fp8_gemm.dequantize_weight(w, s, block)
        # e4m3 keeps 3 mantissa bits: within 1/16 of each value, the block's amax maps to 448
        assert ((back - weight).abs() <= weight.abs() / 16 + 1e-6).all()
        assert w.float().abs().max().item() == FP8_MAX
    scalar = torch.tensor(0.5)
    assert torch.equal(fp8_gemm.dequantize_weight(w, scalar, None), w.float() * 0.5)


@pytest.mark.parametrize("group", [16, 64, 300])
def test_activation_quantization(group: int) -> None:
    x = (torch.randn(5, 300, generator=torch.Generator().manual_seed(group)) * 3).to(DEVICE)
    x[2, :32] = 0.0  # an all-zero group: the floor scale, zeros out
    q, s = fp8_gemm.quantize_activations(x, group)
    q_ref, s_ref = fp8_gemm.quantize_activations_torch(x, group)
    assert s.shape == s_ref.shape == (5, -(-300 // group))
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # the same e4m3 values: nearest, ties to even, subnormals kept (a GPU's division may round a
    # quotient apart now and then)
    same = (q.float() == q_ref.float()).float().mean().item()
    assert same == 1.0 if DEVICE.type == "cpu" else same > 0.99


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("block", [(16, 16), (32, 16), None], ids=["block16", "block32x16", "channel"])
def test_gemm_against_float64(rows: int, block: tuple[int, int] | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMV_ROWS", "0")  # the W8A8 GEMV at one row, not the weight-only one
    n, k = 72, 80  # a partial last row block; K of 5 (or 2.5) column blocks
    w, s = _weight(n, k, block, seed=rows)
    gen = torch.Generator().manual_seed(100 + rows)
    x = (torch.randn(rows, k, generator=gen) * 2).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(DEVICE)
    out = fp8_gemm.fp8_linear(x, w, s, block, bias)
    x_q, x_s = fp8_gemm.quantize_activations(x, fp8_gemm.weight_groups(w.shape, block)[1])
    expected = fp8_linear_reference(x_q, x_s, w, s, block, bias)
    assert out.dtype == x.dtype and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # and near the unquantized product (e4m3's error, nothing structural)
    exact = x.double() @ fp8_gemm.dequantize_weight(w, s, block).double().T + bias.double()
    assert (out.double() - exact).abs().max().item() < 0.1 * exact.abs().max().item()


def test_tile_and_shape_errors() -> None:
    assert fp8_gemm.tile_k(128, 4096) == 128 and fp8_gemm.tile_k(4096, 4096) == 128 and fp8_gemm.tile_k(72, 72) == 128
    with pytest.raises(ValueError, match="power-of-two"):
        fp8_gemm.tile_k(24, 96)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm.fp8_linear(torch.randn(2, 8), torch.randn(4, 8), torch.ones(4, 1), None)
