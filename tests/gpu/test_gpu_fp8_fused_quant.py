"""On a GPU: the FP8 activation quantization fused into RMSNorm and SiLU(gate) * up at Qwen3-8B's
widths in bfloat16, bit-identical to the unfused path in the layout the GEMM takes (cuBLASLt's where
its probe passed, else the Triton GEMM's), the projections' outputs equal; and a tiny FP8 checkpoint
through the engine, CUDA graphs on, gives the same greedy tokens with VLLM_ACTORS_FP8_FUSED_QUANT
at 0, 1 and graphs.

Skipped without CUDA.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support.fp8_checkpoints import quantize_checkpoint
from vllm_actors import LLM, SamplingParams
from vllm_actors.kernels import fp8_gemm, fused_ops
from vllm_actors.kernels.fp8_quant_fused import rms_norm_quant, silu_mul_quant
from vllm_actors.kernels.fp8_scaled_mm import pad_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BLOCK = (128, 128)


def _assert_same(got: fp8_gemm.QuantizedActivations, x: torch.Tensor, plan: fp8_gemm.GemmPlan) -> None:
    layout = plan.layout
    x_q, x_s = fp8_gemm.quantize_activations(pad_rows(x, layout) if layout else x, 128,
                                             column_major=layout is not None and layout.a_column_major)
    assert torch.equal(got.x_q.view(torch.uint8), x_q.view(torch.uint8))
    assert torch.equal(got.x_s, x_s) and got.x_s.stride() == x_s.stride()


@pytest.mark.parametrize("rows", [2, 7, 64, 1000])
def test_fused_quant_bit_identical(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    hidden, inter = 4096, 12288
    x, residual = (torch.randn((rows, hidden), generator=gen, device="cuda").bfloat16() for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(hidden, generator=gen, device="cuda")).bfloat16()
    qkv, qkv_scale = fp8_gemm.quantize_weight(0.02 * torch.randn((6144, hidden), generator=gen, device="cuda"), BLOCK)
    plan = fp8_gemm.gemm_plan(x, qkv, qkv_scale, BLOCK)
    assert not plan.gemv
    for res in (None, residual):
        normed, new_residual = fused_ops.rms_norm(x, norm_weight, 1e-6, res)
        fused, fused_residual = rms_norm_quant(x, norm_weight, 1e-6, res, 128, plan.layout)
        _assert_same(fused, normed, plan)
        assert torch.equal(fused_residual, new_residual)
        assert torch.equal(fp8_gemm.fp8_linear_quantized(fused, qkv, qkv_scale, BLOCK),
                           fp8_gemm.fp8_linear(normed, qkv, qkv_scale, BLOCK))
    gate_up = torch.randn((rows, 2 * inter), generator=gen, device="cuda").bfloat16()
    down, down_scale = fp8_gemm.quantize_weight(0.02 * torch.randn((hidden, inter), generator=gen, device="cuda"),
                                                BLOCK)
    plan = fp8_gemm.gemm_plan(gate_up, down, down_scale, BLOCK)
    fused = silu_mul_quant(gate_up, 128, plan.layout)
    _assert_same(fused, fused_ops.silu_and_mul(gate_up), plan)
    assert torch.equal(fp8_gemm.fp8_linear_quantized(fused, down, down_scale, BLOCK),
                       fp8_gemm.fp8_linear(fused_ops.silu_and_mul(gate_up), down, down_scale, BLOCK))


def test_tiny_fp8_engine_fused_quant_same_tokens(tiny_qwen3: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = quantize_checkpoint(tiny_qwen3, tmp_path / "block", "block", block_size=(32, 32))
    rng = random.Random(5)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (3, 40, 150, 77)]
    monkeypatch.setenv("VLLM_ACTORS_FP8_GEMM", "triton")
    tokens = {}
    for mode in ("0", "1", "graphs"):
        monkeypatch.setenv("VLLM_ACTORS_FP8_FUSED_QUANT", mode)
        with LLM(str(path), executor="inprocess", dtype="bfloat16", max_num_batched_tokens=64, seed=0) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        tokens[mode] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["1"] == tokens["0"] and tokens["graphs"] == tokens["0"]
