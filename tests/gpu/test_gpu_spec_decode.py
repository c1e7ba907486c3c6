"""On a GPU: n-gram speculative decoding through the process group (CUDA graphs, deferred steps,
the fused sampler) gives the tokens decoding without it gives: greedy and seeded sampled rows,
a penalised row and rows asking for logprobs among them; drafts are accepted.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh (or pytest -m gpu).
"""

from __future__ import annotations

import pytest
import torch

from vllm_actors import LLM, SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
TEXT = ("Repeat the following text exactly, word for word:\n\nThe river runs past old stone walls and quiet "
        "fields where farmers count their sheep before winter comes to the valley, and every lamp in town is "
        "lit one by one as the evening bell rings twice.")
PROMPTS = [TEXT, "The capital of France is", TEXT + " Then say it again.", "Write a list of ten colours:"]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=64, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, presence_penalty=0.3),  # sees its drafts
    ]


def _run(default_gguf_path: str, spec: dict[str, object] | None, enforce_eager: bool) -> tuple[list[list[int]], int]:
    speculative_config = parse_speculative_config(spec, adaptive=False) if spec else None
    with LLM(dtype="float32", enforce_eager=enforce_eager, speculative_config=speculative_config) as llm:
        outputs = llm.generate(PROMPTS, _params(), use_tqdm=False)
        accepted = llm.get_metrics().spec_decode.num_accepted_tokens
    return [list(output.outputs[0].token_ids) for output in outputs], accepted


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_ngram_on_gpu_gives_the_tokens_of_no_speculation(default_gguf_path: str, enforce_eager: bool) -> None:
    expected, _ = _run(default_gguf_path, None, enforce_eager)
    got, accepted = _run(default_gguf_path, NGRAM, enforce_eager)
    assert got == expected
    assert accepted > 0


def test_adaptive_policy_on_gpu_keeps_outputs_and_speculates_at_batch_one(default_gguf_path: str) -> None:
    """The default (adaptive) policy: batch 1 on a launch-bound model drafts; outputs unchanged."""
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    with LLM(dtype="float32") as llm:
        expected = llm.generate([TEXT], params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(dtype="float32", speculative_config=NGRAM) as llm:
        for _ in range(3):  # the cost model learns the step times first
            got = llm.generate([TEXT], params, use_tqdm=False)[0].outputs[0].token_ids
            assert got == expected
        assert llm.get_metrics().spec_decode.num_accepted_tokens > 0


@pytest.mark.parametrize("seed", [None, 11], ids=["greedy", "seeded"])
def test_ngram_steps_without_a_match_on_gpu_give_the_tokens_of_no_speculation(default_gguf_path: str,
                                                                            seed: int | None) -> None:
    """Batch 1 on text that copies only in parts: steps whose lookup finds nothing run as plain
    deferred steps (the sampling decode graph draws them, their tokens the next step's deferred
    inputs), between verification steps read back at once; every step is planned with drafts."""
    params = SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_tokens=96, ignore_eos=True)
    prompts = ["Write a list of ten colours:", TEXT]
    expected = []
    with LLM(dtype="float32") as llm:
        for prompt in prompts:
            expected.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    with LLM(dtype="float32", speculative_config=parse_speculative_config(NGRAM, adaptive=False)) as llm:
        for prompt, tokens in zip(prompts, expected, strict=True):
            assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == tokens
        metrics = llm.get_metrics()
    assert 0 < metrics.spec_decode.num_drafts < metrics.steps  # steps without a match drafted nothing
