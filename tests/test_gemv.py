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


def test_config_from_the_environment() -> None:
    config = GemvConfig.from_env({"VLLM_ACTORS_GEMV_BLOCK_N": "8", "VLLM_ACTORS_GEMV_STAGES": "1"})
    assert config == GemvConfig(block_n=8, block_k=GemvConfig().block_k, warps=GemvConfig().warps, stages=1)
