"""The batch-1 GEMV kernel against torch in float64 (Triton's interpreter on the CPU, or a GPU)."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels import gemv as gemv_module  # conftest.py sets TRITON_INTERPRET=1 without CUDA
from vllm_actors.kernels.gemv import GemvConfig, gemv, linear, takes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = torch.bfloat16 if torch.cuda.is_available() else torch.float16  # the interpreter has no bfloat16
pytestmark = pytest.mark.skipif(not gemv_module.HAVE_TRITON, reason="needs triton")


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_against_float64(dtype: torch.dtype, rows: int, with_bias: bool) -> None:
    """N and K not multiples of the blocks: the masked edges count."""
    generator = torch.Generator().manual_seed(rows)
    n, k = 37, 300
    x = torch.randn((rows, k), generator=generator).to(dtype).to(DEVICE)
    weight = torch.randn((n, k), generator=generator).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=generator).to(dtype).to(DEVICE) if with_bias else None
    got = gemv(x, weight, bias, GemvConfig(block_n=16, block_k=128, warps=4, stages=2))
    want = x.double() @ weight.double().t() + (bias.double() if bias is not None else 0.0)
    assert got.dtype == dtype and got.shape == (rows, n)
    tolerance = 1e-6 if dtype == torch.float32 else 4e-3  # the half-precision output's rounding
    assert float((got.double() - want).abs().max() / want.abs().max()) < tolerance


def test_strided_rows_of_x() -> None:
    """A view with a row stride (rows of a wider tensor) reads the right elements."""
    generator = torch.Generator().manual_seed(7)
    wide = torch.randn((3, 200), generator=generator).to(DEVICE)
    weight = torch.randn((24, 100), generator=generator).to(DEVICE)
    x = wide[:, :100]
    got = gemv(x, weight, config=GemvConfig(block_n=8, block_k=64, warps=2, stages=1))
    want = x.double() @ weight.double().t()
    assert float((got.double() - want).abs().max() / want.abs().max()) < 1e-6


def test_bad_shapes_are_refused() -> None:
    weight = torch.zeros((8, 16), device=DEVICE)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.zeros((5, 16), device=DEVICE), weight)
    with pytest.raises(ValueError, match="contiguous rows"):
        gemv(torch.zeros((1, 8), device=DEVICE), weight)


def test_linear_takes_only_few_half_precision_rows_on_a_gpu() -> None:
    module = torch.nn.Linear(16, 8).to(HALF)
    x = torch.randn((1, 16)).to(HALF)
    assert not takes(x, module.weight)  # on the CPU: F.linear
    assert torch.equal(linear(x, module), torch.nn.functional.linear(x, module.weight, module.bias))
    if torch.cuda.is_available():
        cuda = module.cuda()
        assert takes(x.cuda(), cuda.weight)
        assert takes(torch.zeros((2, 16), device="cuda", dtype=HALF), cuda.weight)
        assert not takes(torch.zeros((3, 16), device="cuda", dtype=HALF), cuda.weight)  # cuBLAS is faster there
        assert not takes(torch.zeros((1, 16), device="cuda"), cuda.weight.float())


def test_config_defaults_and_prefetch_bounds() -> None:
    """The launch parameters are constants now (the sweep's best; VLLM_ACTORS_GEMV_* are gone)."""
    assert GemvConfig() == GemvConfig(block_n=8, block_k=1024, warps=4, stages=2, prefetch=2)
    for bad in (-1, 5):
        with pytest.raises(ValueError, match="prefetch must be 0..4"):
            GemvConfig(prefetch=bad)


def test_programmatic_dependent_launch_stays_off_without_a_hopper_gpu_or_the_variable() -> None:
    from vllm_actors.kernels.pdl import pdl

    assert pdl(torch.zeros(1)) == {"PDL": False}  # the CPU: launched as before, pdl_enter does nothing


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_the_folded_silu_mul_equals_the_separate_kernel_then_the_gemv(dtype: torch.dtype,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """One row of [gate | up]: the GEMV that reads SiLU(gate) * up itself gives the same bits as
    ``silu_and_mul``'s kernel followed by the GEMV (the same roundings, the same sums)."""
    from vllm_actors.kernels.fused_ops import silu_and_mul

    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "triton")
    generator = torch.Generator().manual_seed(5)
    k, n = 200, 24
    gate_up = torch.randn((1, 2 * k), generator=generator).to(dtype).to(DEVICE)
    weight = torch.randn((n, k), generator=generator).to(dtype).to(DEVICE)
    config = GemvConfig(block_n=8, block_k=64, warps=2, stages=1)
    folded = gemv(gate_up, weight, config=config, silu_mul=True)
    assert torch.equal(folded, gemv(silu_and_mul(gate_up), weight, config=config))
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.zeros((2, 2 * k), dtype=dtype, device=DEVICE), weight, silu_mul=True)


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("k", [40, 100, 200, 300])  # within 1, 2, 4 tiles of 64, beyond them
def test_prefetched_weight_tiles_give_the_same_bits(silu_mul: bool, k: int) -> None:
    """One row with 1 to 4 weight tiles loaded before the wait on the predecessor (``prefetch``):
    the same sums in the same order as without, whether K ends inside the prefetched tiles or not."""
    generator = torch.Generator().manual_seed(k)
    n = 21
    x = torch.randn((1, 2 * k if silu_mul else k), generator=generator).to(HALF).to(DEVICE)
    weight = torch.randn((n, k), generator=generator).to(HALF).to(DEVICE)
    bias = torch.randn(n, generator=generator).to(HALF).to(DEVICE)
    base = GemvConfig(block_n=8, block_k=64, warps=2, stages=1, prefetch=0)
    want = gemv(x, weight, bias, base, silu_mul=silu_mul)
    for prefetch in (1, 2, 3, 4):
        config = GemvConfig(block_n=8, block_k=64, warps=2, stages=1, prefetch=prefetch)
        assert torch.equal(gemv(x, weight, bias, config, silu_mul=silu_mul), want)
    if not silu_mul:
        exact = x.double() @ weight.double().t() + bias.double()
        assert float((want.double() - exact).abs().max() / exact.abs().max()) < 4e-3
    two_rows = torch.randn((2, k), generator=generator).to(HALF).to(DEVICE)  # prefetch is one row's only
    assert torch.equal(gemv(two_rows, weight, bias, GemvConfig(block_n=8, block_k=64, warps=2, stages=1, prefetch=2)),
                       gemv(two_rows, weight, bias, base))
