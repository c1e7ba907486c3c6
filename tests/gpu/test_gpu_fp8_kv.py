"""On a GPU: an fp8 KV cache through the Triton kernels (fused rotary write, varlen, split decode)
with CUDA graphs gives the torch reference's tokens (same stored bytes, float32 attention).

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from vllm_actors import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _generate(model: Path, prompts: list[list[int]], **engine: object) -> tuple[list[list[int]], list[float]]:
    with LLM(str(model), executor="inprocess", dtype="float32", kv_cache_dtype="fp8", num_gpu_blocks_override=96,
             max_num_batched_tokens=128, **engine) as llm:  # type: ignore[arg-type]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        runner = llm.engine.worker.runner  # type: ignore[attr-defined]  # the in-process engine's
        assert all(k.dtype == torch.float8_e4m3fn for k, _ in runner.kv_caches)
        scales = [attn.k_scale.item() for attn in runner.model.attention_layers()]
    return [o.outputs[0].token_ids for o in outputs], scales


@pytest.mark.parametrize("calculate", [False, True])
def test_fp8_triton_with_graphs_matches_the_torch_reference(
    tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch, calculate: bool
) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(500) for _ in range(rng.randint(1, 300))] for _ in range(24)]
    triton_tokens, triton_scales = _generate(tiny_qwen3, prompts, calculate_kv_scales=calculate)
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "torch")
    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "torch")
    torch_tokens, torch_scales = _generate(tiny_qwen3, prompts, calculate_kv_scales=calculate, enforce_eager=True)
    assert (triton_scales != [1.0] * 3) is calculate
    # a deeper layer's keys come through the earlier layers' attention, whose kernels round differently
    # (measured on an H100: 1.1e-4 relative at the third layer)
    assert triton_scales == pytest.approx(torch_scales, rel=1e-3)
    # the same bytes stored; float32 rounding noise may move an fp8 value by one step at a midpoint
    same = sum(a == b for a, b in zip(triton_tokens, torch_tokens, strict=True))
    assert same >= 22, f"{same} of 24 prompts give the torch reference's tokens"
