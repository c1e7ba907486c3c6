"""On a GPU: the host KV tier's copies (pinned host memory, their own CUDA stream) under CUDA
graphs and deferred steps: prefixes evicted from a small pool come back from the host and every
output is the one of a run without the tier.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from vllm_actors import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("executor", ["inprocess", "group"])
def test_restored_prefixes_on_gpu_give_the_outputs_of_a_run_without_the_tier(tiny_qwen3: Path, executor: str) -> None:
    rng = random.Random(3)
    results: dict[float, list[list[int]]] = {}
    prompts: list[list[int]] = []
    for offload_gb in (0.0, 0.05):
        with LLM(str(tiny_qwen3), executor=executor, dtype="float32", num_gpu_blocks_override=40,
                 max_num_batched_tokens=256, kv_cache_offload_gb=offload_gb) as llm:
            if not prompts:
                systems = [[rng.randrange(llm.vocab_size) for _ in range(n)] for n in (160, 200, 240)]
                prompts = [systems[i % 3] + [rng.randrange(llm.vocab_size) for _ in range(rng.randint(1, 40))]
                           for i in range(12)]
            params = SamplingParams(temperature=0.0, max_tokens=16)
            outputs = []
            for prompt in prompts:  # one at a time: each system prompt is evicted before it comes back
                outputs += [o.outputs[0].token_ids for o in llm.generate(
                    [{"prompt_token_ids": prompt}], params, use_tqdm=False)]
            metrics = llm.get_metrics()
            if offload_gb:
                assert metrics.kv_blocks_offloaded > 0 and metrics.kv_blocks_restored > 0
            results[offload_gb] = outputs
    assert results[0.05] == results[0.0]


def test_long_prompts_written_through_on_gpu_give_the_outputs_of_a_run_without_the_tier(
        tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a supervisor the tier is the supervisor's shared memory, pinned by the worker; long
    prompts' blocks are written through to it on the copy stream beside the next step. Outputs match
    a run without the tier, and the copies were made (a worker killed mid-request:
    tests/process_group/test_supervision.py, which runs on the GPU where there is one)."""
    monkeypatch.setenv("VLLM_ACTORS_KV_OFFLOAD_WRITE_THROUGH_TOKENS", "256")
    rng = random.Random(4)
    results: dict[float, list[list[int]]] = {}
    prompts: list[list[int]] = []
    for offload_gb in (0.0, 0.05):
        with LLM(str(tiny_qwen3), executor="group", dtype="float32", num_gpu_blocks_override=200,
                 max_num_batched_tokens=128, kv_cache_offload_gb=offload_gb) as llm:
            if not prompts:
                prompts = [[rng.randrange(llm.vocab_size) for _ in range(n)] for n in (300, 700, 900)]
            outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in prompts],
                                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
            results[offload_gb] = [output.outputs[0].token_ids for output in outputs]
            if offload_gb:
                assert llm.get_metrics().kv_blocks_offloaded >= (300 + 700 + 900) // 16 - 3
    assert results[0.05] == results[0.0]
