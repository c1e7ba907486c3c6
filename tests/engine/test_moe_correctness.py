"""Mixture-of-experts models through the engine (in process): greedy output token-identical to
transformers (float32, CPU) for tiny Qwen3-MoE and Mixtral, under preemption and chunked prefill."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.engine.test_correctness import reference_generate
from tests.support.lifecycle import settled_metrics
from vllm_actors import LLM, SamplingParams

PROMPT_LENGTHS = [1, 5, 31, 90, 200, 300]
NUM_BLOCKS = 20  # 320 tokens for 6 prompts of up to 300 (+ 12 generated): preemption
MAX_TOKENS = 12


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_greedy_matches_transformers_under_preemption_and_chunking(
    checkpoint: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    rng = random.Random(31)
    prompts = [[rng.randrange(500) for _ in range(length)] for length in PROMPT_LENGTHS]
    with LLM(str(path), executor="inprocess", dtype="float32", device="cpu", block_size=16,
             num_gpu_blocks_override=NUM_BLOCKS, max_num_batched_tokens=64, seed=0) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1), use_tqdm=False)
        metrics = settled_metrics(llm, lambda m: m.kv_blocks_in_use == 0 and m.requests_finished == len(prompts))
    assert metrics.preemptions > 0, "the KV pool was meant to force preemption"
    assert metrics.prefill_chunks > len(prompts), "the token budget was meant to force chunking"

    reference = reference_generate(path, prompts, MAX_TOKENS)
    for index, (output, (tokens, logits)) in enumerate(zip(outputs, reference, strict=True)):
        completion = output.outputs[0]
        assert completion.token_ids == tokens, f"prompt {index} (length {PROMPT_LENGTHS[index]})"
        expected = torch.log_softmax(logits, dim=-1)
        for step, (token, entry) in enumerate(zip(tokens, completion.logprobs or [], strict=True)):
            assert abs(entry[token].logprob - float(expected[step, token])) < 1e-4, (index, step)
