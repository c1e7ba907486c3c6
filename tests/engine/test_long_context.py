"""Long contexts with scaled RoPE through the engine: a tiny Llama (llama3 rope) and a tiny Qwen3
(yarn) over thousands of tokens, prefilled in many chunks, then a second request on the first one's
cached prefix; greedy tokens and log-probabilities against transformers (float32, CPU)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from tests.support.lifecycle import settled_metrics
from tests.support.tiny_models import build_checkpoint
from vllm_actors import LLM, SamplingParams

# Extended to 8192 positions from shorter pretraining lengths, so that the scaled part of the
# frequencies matters over the prompt; two layers keep an 8k-token transformers forward quick.
SHAPE = {"max_position_embeddings": 8192, "num_hidden_layers": 2}
ROPES: dict[str, tuple[Literal["llama", "qwen3"], dict[str, Any]]] = {
    "llama3": ("llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 1024}),
    "yarn": ("qwen3", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}),
}
PROMPT, SHARED, OWN, MAX_TOKENS, BUDGET = 6000, 5600, 300, 6, 512
# ours computes rotary angles in float64, transformers in float32 (off by up to ~5e-4 rad at 6k
# positions): the log-probabilities differ by up to ~6e-4 here; a rope type mis-applied moves them by >1
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module", params=sorted(ROPES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    arch, rope = ROPES[request.param]
    return build_checkpoint(tmp_path_factory.mktemp(f"long_{request.param}"), arch,
                            tie_word_embeddings=arch == "qwen3", seed=5, rope_scaling=rope, shape=SHAPE)


def hf_log_probs(path: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' log-probabilities of the next token after each position of each sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s])).logits[0].float(), dim=-1) for s in sequences]


def test_long_prompt_in_chunks_and_a_cached_prefix_match_transformers(checkpoint: Path) -> None:
    check_long_context(checkpoint)


def check_long_context(checkpoint: Path, **engine_args: Any) -> None:
    """Two greedy requests (the second on the first's cached prefix) against transformers."""
    rng = random.Random(17)
    with LLM(str(checkpoint), dtype="float32", block_size=16, max_num_batched_tokens=BUDGET, seed=0,
             **engine_args) as llm:
        assert llm.max_model_len == 8192  # the derived limit: llama3 as configured, yarn 2048 * 4
        first = [rng.randrange(llm.vocab_size) for _ in range(PROMPT)]
        second = first[:SHARED] + [rng.randrange(llm.vocab_size) for _ in range(OWN)]
        greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
        out_first = llm.generate({"prompt_token_ids": first}, greedy.clone(prompt_logprobs=1), use_tqdm=False)[0]
        out_second = llm.generate({"prompt_token_ids": second}, greedy, use_tqdm=False)[0]
        metrics = settled_metrics(llm, lambda m: m.kv_blocks_in_use == 0 and m.requests_finished == 2)
    assert metrics.prefill_chunks >= PROMPT // BUDGET, "the token budget was meant to split the prompts"
    assert metrics.prefix_cache_hits > 0, "the second prompt was meant to reuse the first one's blocks"

    outputs = [out_first.outputs[0], out_second.outputs[0]]
    prompts = [first, second]
    expected = hf_log_probs(checkpoint, [p + o.token_ids for p, o in zip(prompts, outputs, strict=True)])
    for prompt, output, log_probs in zip(prompts, outputs, expected, strict=True):
        assert len(output.token_ids) == MAX_TOKENS and output.logprobs is not None
        steps = log_probs[len(prompt) - 1 : -1]  # the distributions each generated token was drawn from
        for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
            top2 = steps[step].topk(2)
            margin = float(top2.values[0] - top2.values[1])
            assert token == int(top2.indices[0]) or margin < LOGPROB_TOLERANCE, (step, margin)
            assert abs(entry[token].logprob - float(steps[step, token])) < LOGPROB_TOLERANCE, step
    # every prompt position of the chunked prefill, against transformers' one forward
    assert out_first.prompt_logprobs is not None
    ours = torch.tensor([out_first.prompt_logprobs[i][first[i]].logprob for i in range(1, PROMPT)])
    theirs = expected[0][torch.arange(PROMPT - 1), torch.tensor(first[1:])]
    assert float((ours - theirs).abs().max()) < LOGPROB_TOLERANCE
