"""The dense families end to end: greedy output token-identical to transformers (float32, CPU) under
preemption and chunked prefill, prompts up to 300 tokens against sliding windows of 8 to 16."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.engine.test_correctness import reference_generate
from tests.support.lifecycle import settled_metrics
from tests.support.tiny_families import FAMILIES
from tests.support.tiny_models import build_checkpoint
from vllm_actors import LLM, SamplingParams

# fewer and shorter than test_correctness's (four engines here): 793 prompt tokens in a 640-token pool
PROMPT_LENGTHS = [3, 18, 64, 150, 258, 300]
MAX_TOKENS = 12


# Phi-3 differs from Mistral only in its checkpoint's fused names: tests/models/test_dense_families.py
ENGINE_FAMILIES = tuple(arch for arch in FAMILIES if arch != "phi3")


@pytest.mark.parametrize("arch", ENGINE_FAMILIES)
def test_greedy_matches_transformers_under_preemption_and_chunking(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    shape = {"num_hidden_layers": 6} if arch == "gemma3_text" else None
    path: Path = build_checkpoint(tmp_path_factory.mktemp(arch), arch, tie_word_embeddings=arch != "qwen2", seed=9,
                                  shape=shape)  # fmt: skip
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=16,
        num_gpu_blocks_override=40,  # 640 tokens: forces preemption
        max_num_batched_tokens=64,  # forces chunked prefill
        seed=0,
    )
    try:
        rng = random.Random(20 + FAMILIES.index(arch))
        prompts = [[rng.randrange(llm.vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]
        outputs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            use_tqdm=False,
        )
        metrics = settled_metrics(llm, lambda m: m.kv_blocks_in_use == 0 and m.requests_finished == len(prompts))
        assert metrics.preemptions > 0, "the KV pool was meant to force preemption"
        assert metrics.prefill_chunks > len(prompts), "the token budget was meant to force chunking"
    finally:
        llm.shutdown()
    # eager: transformers' SDPA path drops Gemma 2's attention soft cap
    reference = reference_generate(path, prompts, attn_implementation="eager")
    for length, output, (tokens, logits) in zip(PROMPT_LENGTHS, outputs, reference, strict=True):
        ours = output.outputs[0].token_ids[:MAX_TOKENS]
        assert ours == tokens[:MAX_TOKENS], f"{arch}, prompt of {length}: {ours} != {tokens} ({logits.shape})"
