"""Greedy output token-identical to transformers (float32, CPU), under preemption and chunked prefill."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support.lifecycle import settled_metrics
from vllm_actors import LLM, SamplingParams

MAX_TOKENS = 24
PROMPT_LENGTHS = [1, 2, 3, 5, 8, 13, 17, 31, 47, 64, 90, 128, 150, 200, 256, 300]


def random_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for length in PROMPT_LENGTHS]


def reference_generate(path: Path, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
                       **load: object) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy generate, one prompt at a time: (tokens, per-step float32 logits)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **load)
    model.eval()
    results = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones((1, len(prompt)), dtype=torch.long),
                max_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=model.generation_config.eos_token_id,
            )
            tokens = out.sequences[0, len(prompt):].tolist()
            logits = torch.stack([step[0] for step in out.logits]).float()
            results.append((tokens[: len(logits)], logits))
    return results


def describe_mismatch(index: int, ours: list[int], theirs: list[int], logits: torch.Tensor) -> str:
    position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if position < len(logits):
        top2 = logits[position].topk(2).values
        margin = f"top-2 logit margin there: {float(top2[0] - top2[1]):.3g}"
    else:
        margin = "lengths differ"
    return f"prompt {index} (length {PROMPT_LENGTHS[index]}) diverges at output {position}: {margin}"


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3", "tiny_llama"])
def test_greedy_matches_transformers_under_preemption_and_chunking(
    checkpoint: str, request: pytest.FixtureRequest
) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=16,
        num_gpu_blocks_override=40,  # 640 tokens for 16 prompts of up to 300: forces preemption
        max_num_batched_tokens=64,  # forces chunked prefill
        seed=0,
    )
    vocab = llm.vocab_size
    prompts = random_prompts(vocab, seed={"tiny_qwen3": 11, "tiny_llama": 12}[checkpoint])
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1),
        use_tqdm=False,
    )
    metrics = settled_metrics(llm, lambda m: m.kv_blocks_in_use == 0 and m.requests_finished == len(prompts))
    assert metrics.preemptions > 0, "the KV pool was meant to force preemption"
    assert metrics.prefill_chunks > len(prompts), "the token budget was meant to force chunking"
    assert metrics.kv_blocks_in_use == 0 and metrics.kv_blocks_total == 40
    assert metrics.requests_finished == len(prompts) and metrics.running == 0 and metrics.waiting == 0

    reference = reference_generate(path, prompts)
    for index, (output, (tokens, logits)) in enumerate(zip(outputs, reference, strict=True)):
        completion = output.outputs[0]
        assert completion.token_ids == tokens, describe_mismatch(index, completion.token_ids, tokens, logits)
        expected = torch.log_softmax(logits, dim=-1)
        for step, (token, position_logprobs) in enumerate(zip(tokens, completion.logprobs, strict=True)):
            ours = position_logprobs[token].logprob
            assert abs(ours - float(expected[step, token])) < 1e-4, (index, step)
    llm.shutdown()


def test_prompt_logprobs_match_transformers(tiny_qwen3: Path) -> None:
    from transformers import AutoModelForCausalLM

    with LLM(str(tiny_qwen3), dtype="float32", max_num_batched_tokens=16) as llm:
        prompt = random_prompts(llm.vocab_size, seed=5)[9]  # 64 tokens, 4 chunks
        output = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                              use_tqdm=False)[0]
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert output.prompt_logprobs is not None and output.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        assert entry is not None and len(entry) <= 3
        actual = prompt[position]
        assert abs(entry[actual].logprob - float(expected[position - 1, actual])) < 1e-4
        top = expected[position - 1].topk(2).indices.tolist()
        assert set(top) <= set(entry)


def shared_prefix_prompts(vocab_size: int, seed: int) -> list[list[int]]:
    """16 prompts over 3 shared system prompts (40, 70 and 100 tokens) with 1-30 own tokens."""
    rng = random.Random(seed)
    systems = [[rng.randrange(vocab_size) for _ in range(length)] for length in (40, 70, 100)]
    return [systems[i % 3] + [rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))] for i in range(16)]


def test_greedy_with_prefix_caching_matches_transformers_and_caching_off(tiny_qwen3: Path) -> None:
    """Two rounds through the process group - shared system prompts, then each conversation's
    next turn (prompt + reply + new tokens) - in a pool that forces eviction and preemption: the
    same tokens as transformers and as caching off."""
    outputs: dict[bool, list[list[int]]] = {}
    rng = random.Random(21)
    first_round: list[list[int]] = []
    second_round: list[list[int]] = []
    for caching in (True, False):
        with LLM(str(tiny_qwen3), dtype="float32", block_size=16, num_gpu_blocks_override=40,
                 max_num_batched_tokens=128, enable_prefix_caching=caching, seed=0) as llm:
            if not first_round:
                first_round = shared_prefix_prompts(llm.vocab_size, seed=13)
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
            replies = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in first_round], params, use_tqdm=False)]
            if not second_round:
                second_round = [p + r + [rng.randrange(llm.vocab_size) for _ in range(rng.randint(5, 20))]
                                for p, r in zip(first_round, replies, strict=True)]
            replies += [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in second_round], params, use_tqdm=False)]
            total = 2 * len(first_round)
            metrics = settled_metrics(
                llm, lambda m, total=total: m.kv_blocks_in_use == 0 and m.requests_finished == total
            )
            if caching:
                assert metrics.prefix_cache_hits > 0 and metrics.prefix_cache_queries > metrics.prefix_cache_hits
                assert metrics.kv_blocks_evicted > 0, "the pool was meant to force eviction"
                assert metrics.preemptions > 0, "the pool was meant to force preemption"
            else:
                assert metrics.prefix_cache_queries == 0 and metrics.kv_blocks_cached == 0
            outputs[caching] = replies
    prompts = first_round + second_round
    reference = reference_generate(tiny_qwen3, prompts)
    for index, (ours, (tokens, logits)) in enumerate(zip(outputs[True], reference, strict=True)):
        assert ours == tokens, f"prompt {index}: " + describe_mismatch(0, ours, tokens, logits).split(": ", 1)[-1]
    assert outputs[True] == outputs[False]
