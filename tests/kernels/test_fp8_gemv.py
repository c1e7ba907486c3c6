"""The weight-only FP8 GEMV (activations not quantized) against float64 on the dequantized weight
(Triton's interpreter on the CPU): block scales with partial blocks and K not a multiple of the
group, per-channel scales, 1 to 4 rows, the fused SiLU * up read, several K tiles with and without
the prefetched ones; and ``fp8_linear``'s choice between it and the W8A8 path by rows."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels import fp8_gemm, fp8_gemv
from vllm_actors.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fp8_gemm.HAVE_TRITON, reason="needs triton")
N, K = 72, 88  # a partial last row of blocks; K of 5.5 groups of 16


def _problem(rows: int, k: int, block: tuple[int, int] | None, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(N, K, generator=gen) * torch.rand(N, 1, generator=gen)  # rows of unlike ranges
    w, s = fp8_gemm.quantize_weight(weight, block)
    x = torch.randn(rows, k, generator=gen) * 2
    bias = torch.randn(N, generator=gen)
    return x.to(DEVICE), w.to(DEVICE), s.to(DEVICE), bias.to(DEVICE)


@pytest.mark.parametrize(("block", "config", "row_counts"), [
    ((16, 16), Fp8GemvConfig(), (1, 4)), ((16, 16), Fp8GemvConfig(block_k=32, prefetch=2), (1, 2)),
    ((32, 16), Fp8GemvConfig(block_n=16, block_k=16, prefetch=0), (3, 4)),
    ((16, 32), Fp8GemvConfig(block_k=16, prefetch=1), (1, 3)),
    (None, Fp8GemvConfig(block_k=32, prefetch=1, tiles=1), (1, 2, 3, 4)),
], ids=["block16-one_tile", "block16-tiles_prefetched", "block32x16-tiles", "block16x32-groups_span_tiles",
        "channel-tiles"])
def test_gemv_against_float64(block: tuple[int, int] | None, config: Fp8GemvConfig, row_counts: tuple[int, ...],
                              ) -> None:
    for rows in row_counts:
        x, w, s, bias = _problem(rows, K, block, seed=rows)
        out = fp8_gemv.fp8_gemv(x, w, s, block, bias if rows % 2 else None, config=config)
        expected = fp8_gemv_reference(x, w, s, block, bias if rows % 2 else None)
        assert out.dtype == x.dtype and out.shape == (rows, N)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [(16, 16), None], ids=["block16", "channel"])
def test_gemv_reads_silu_mul(block: tuple[int, int] | None) -> None:
    gate_up, w, s, bias = _problem(1, 2 * K, block, seed=7)
    out = fp8_gemv.fp8_gemv(gate_up, w, s, block, bias, config=Fp8GemvConfig(block_k=32), silu_mul=True)
    torch.testing.assert_close(out.double(), fp8_gemv_reference(gate_up, w, s, block, bias, silu_mul=True),
                               rtol=1e-5, atol=1e-5)


def test_fp8_linear_takes_the_gemv_up_to_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to VLLM_ACTORS_FP8_GEMV_ROWS rows the activations stay unquantized (the W8A16 reference),
    above (or with 0) they are quantized per token group (the W8A8 reference); the two differ."""
    block = (16, 16)
    for limit in (4, 0):
        monkeypatch.setenv("VLLM_ACTORS_FP8_GEMV_ROWS", str(limit))
        for rows in (1, 4, 5):
            x, w, s, bias = _problem(rows, K, block, seed=10 + rows)
            out = fp8_gemm.fp8_linear(x, w, s, block, bias).double()
            x_q, x_s = fp8_gemm.quantize_activations(x, 16)
            w8a8 = fp8_gemm.fp8_linear_reference(x_q, x_s, w, s, block, bias)
            w8a16 = fp8_gemv_reference(x, w, s, block, bias)
            want, other = (w8a16, w8a8) if rows <= limit else (w8a8, w8a16)
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
            assert (out - other).abs().max().item() > 1e-3  # the activations' e4m3 rounding, or not


def test_gemv_shape_and_scale_errors() -> None:
    x, w, s, _ = _problem(1, K, (16, 16), seed=0)
    assert fp8_gemv.takes(w, s, (16, 16)) and not fp8_gemv.takes(w, s, (4, 16))
    with pytest.raises(ValueError, match="blocks of a multiple of 8 rows"):
        fp8_gemv.fp8_gemv(x, w, s, (4, 16))
    with pytest.raises(ValueError, match=r"x \[1..4, K\]"):
        fp8_gemv.fp8_gemv(torch.cat([x] * 5), w, s, (16, 16))
    with pytest.raises(ValueError, match="one row of"):
        fp8_gemv.fp8_gemv(x[:, :87], w, s, (16, 16), silu_mul=True)
    with pytest.raises(ValueError, match="power-of-two width"):
        fp8_gemv.fp8_gemv(x, w, s, (16, 24))
    with pytest.raises(ValueError, match="powers of two"):
        Fp8GemvConfig(block_k=48)
    with pytest.raises(ValueError, match="tiles must be 1 or 2"):
        Fp8GemvConfig(tiles=3)


def test_fp8_down_projection_fuses_silu_only_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Fp8Linear.silu_mul_forward`` at one row: unfused by default (the fused GEMV measured slower on an
    H200), fused under VLLM_ACTORS_FP8_GEMV_SILU=1; both give x's SiLU(gate) * up times the weight."""
    from vllm_actors.models.fp8 import Fp8Linear
    from vllm_actors.models.quant_config import Fp8Scheme

    block = (16, 16)
    gate_up, w, s, _ = _problem(1, 2 * K, block, seed=9)
    scheme = Fp8Scheme("fp8", "block", "weight_scale_inv", block)
    linear = Fp8Linear(torch.nn.Linear(K, N, bias=False, device=DEVICE), scheme)
    linear.weight.data.copy_(w)
    linear.scales.data.copy_(s)
    calls: list[bool] = []
    real = fp8_gemv.fp8_gemv
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", lambda *a, silu_mul=False, **kw: calls.append(silu_mul) or real(
        *a, silu_mul=silu_mul, **kw))
    expected = fp8_gemv_reference(gate_up, w, s, block, silu_mul=True)
    for switch, fused in (("0", False), ("1", True)):
        monkeypatch.setenv("VLLM_ACTORS_FP8_GEMV_SILU", switch)
        calls.clear()
        torch.testing.assert_close(linear.silu_mul_forward(gate_up).double(), expected, rtol=1e-4, atol=1e-4)
        assert calls == [fused], (switch, calls)
