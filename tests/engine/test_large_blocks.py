"""KV blocks of 128 tokens (flash-attn 4's key tile on Hopper, whose pages then load by TMA): chunked
prefill over many chunks, a prompt cached in part by a neighbour, and decode across block boundaries
give transformers' greedy tokens in float32 on the CPU, as blocks of 16 do."""

from __future__ import annotations

import random
from pathlib import Path

from tests.engine.test_correctness import reference_generate
from vllm_actors import LLM, SamplingParams


def test_blocks_of_128_tokens_match_transformers(tiny_llama: Path) -> None:
    rng = random.Random(34)
    shared = [rng.randrange(500) for _ in range(300)]  # two whole blocks of 128 cached for the second prompt
    prompts = [shared + [rng.randrange(500) for _ in range(150)], shared + [rng.randrange(500) for _ in range(60)],
               [rng.randrange(500) for _ in range(120)]]  # the last ends 8 tokens short of a block
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    with LLM(str(tiny_llama), dtype="float32", executor="inprocess", block_size=128, max_num_batched_tokens=96,
             max_model_len=1024, seed=0) as llm:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    outputs = [o.outputs[0].token_ids for o in first + rest]
    assert rest[0].num_cached_tokens == 256, "the second prompt was meant to find two cached blocks"
    reference = reference_generate(tiny_llama, prompts, max_tokens=10)
    assert outputs == [tokens for tokens, _ in reference]
