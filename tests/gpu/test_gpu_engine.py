"""On a GPU: the engine with the Triton kernels and CUDA graphs against transformers (float32).

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from vllm_actors import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MAX_TOKENS = 24


def _prompts(vocab: int, count: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(count)]


def _reference(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).cuda().eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                       do_sample=False, pad_token_id=model.generation_config.eos_token_id)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@pytest.mark.parametrize("executor", ["inprocess", "group"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_on_gpu_matches_transformers(tiny_qwen3: Path, executor: str, enforce_eager: bool) -> None:
    from vllm_actors.kernels.attention import get_attention_backend

    assert type(get_attention_backend(torch.device("cuda"))).__name__ == "TritonPagedAttention"
    with LLM(str(tiny_qwen3), executor=executor, dtype="float32", enforce_eager=enforce_eager,
             num_gpu_blocks_override=64, max_num_batched_tokens=128) as llm:
        prompts = _prompts(llm.vocab_size)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    expected = _reference(tiny_qwen3, prompts)
    for index, (output, tokens) in enumerate(zip(outputs, expected, strict=True)):
        assert output.outputs[0].token_ids == tokens, index


def test_prefix_caching_on_gpu_matches_transformers_and_caching_off(tiny_qwen3: Path) -> None:
    """Shared system prompts and a second turn over each reply, through the Triton kernels with
    CUDA graphs, in a pool small enough to evict: hits read the cached prefix through the block
    table and give transformers' tokens."""
    rng = random.Random(1)
    results: dict[bool, list[list[int]]] = {}
    prompts: list[list[int]] = []
    for caching in (True, False):
        with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32", enable_prefix_caching=caching,
                 num_gpu_blocks_override=48, max_num_batched_tokens=256) as llm:
            if not prompts:
                systems = [[rng.randrange(llm.vocab_size) for _ in range(n)] for n in (48, 100, 150)]
                prompts = [systems[i % 3] + [rng.randrange(llm.vocab_size) for _ in range(rng.randint(1, 40))]
                           for i in range(18)]
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
            first = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
            turns = [p + r + [7, 8, 9] for p, r in zip(prompts, first, strict=True)]
            second = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": t} for t in turns], params, use_tqdm=False)]
            metrics = llm.get_metrics()
            if caching:
                assert metrics.prefix_cache_hits > 0 and metrics.kv_blocks_evicted > 0
            results[caching] = first + second
    assert results[True] == results[False]
    replies = results[True][: len(prompts)]
    expected = _reference(tiny_qwen3, prompts + [p + r + [7, 8, 9] for p, r in zip(prompts, replies, strict=True)])
    for index, (ours, tokens) in enumerate(zip(results[True], expected, strict=True)):
        assert ours == tokens, index
