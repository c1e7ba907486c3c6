"""On two GPUs: KVP=2 (each rank's partial attention on the Triton kernels, decode steps in CUDA
graphs with the NCCL all-gather of every layer's partials captured too) greedy token-identical to
one GPU in float32, with logprobs within 1e-3, on the tiny Qwen3 (one KV head) and Llama (six KV
heads) checkpoints of the CPU tests, with preemption and chunked prefill; a 1,000-token prompt in
16 chunks too; on four GPUs KVP=2 x TP=2 as well.

Skipped without two CUDA devices (the KVP x TP test without four); run on nvidia-h100-x2 by
``pytest -m gpu tests/gpu/test_gpu_kv_parallel.py``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.test_gpu_pipeline_parallel import MAX_TOKENS, _prompts, pytestmark  # noqa: F401 (2 GPUs, marked gpu)
from vllm_actors import LLM, SamplingParams


def _generate(path: Path, prompts: list[list[int]], **engine: Any) -> tuple[list[list[int]], list[list[float]]]:
    with LLM(str(path), dtype="float32", seed=0, **engine) as llm:
        if engine.get("kv_parallel_size", 1) > 1:
            assert llm.group is not None and llm.group.worker_info["attention"] == "triton+kv_parallel"
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        scored = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    logprobs = [[entry[token].logprob for entry, token in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids,
                                                               strict=True)] for o in scored]
    return [list(o.outputs[0].token_ids) for o in scored], logprobs


def _same(got: tuple[list[list[int]], list[list[float]]], want: tuple[list[list[int]], list[list[float]]]) -> None:
    assert got[0] == want[0]
    for ours, theirs in zip(got[1], want[1], strict=True):
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3_tp", "tiny_llama_tp"])
def test_kvp2_greedy_equals_one_gpu(checkpoint: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    prompts = _prompts(500)
    engine = dict(num_gpu_blocks_override=64, max_num_batched_tokens=256)  # preemption and chunks
    _same(_generate(path, prompts, kv_parallel_size=2, **engine), _generate(path, prompts, **engine))


def test_kvp2_long_prompt_in_many_chunks_equals_one_gpu(tiny_qwen3_tp: Path) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(1000)], *_prompts(500, count=4)]  # the model's 1,024 positions
    # a small pool: the suite checks the pool's invariants at every message, and a whole GPU's pool of a
    # tiny model (millions of blocks) made that take minutes
    engine = dict(max_num_batched_tokens=64, max_model_len=1024, num_gpu_blocks_override=256)
    _same(_generate(tiny_qwen3_tp, prompts, kv_parallel_size=2, **engine), _generate(tiny_qwen3_tp, prompts, **engine))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_kvp2_tp2_greedy_equals_one_gpu(tiny_llama_tp: Path) -> None:
    prompts = _prompts(500, count=12)
    engine = dict(num_gpu_blocks_override=64, max_num_batched_tokens=256)
    _same(_generate(tiny_llama_tp, prompts, kv_parallel_size=2, tensor_parallel_size=2, **engine),
          _generate(tiny_llama_tp, prompts, **engine))
