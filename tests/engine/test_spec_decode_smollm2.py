"""Speculative decoding (n-gram) on the embedded SmolLM2-135M (real weights, float32, in process):
greedy output identical to decoding without it, on a prompt that repeats text (drafts accepted,
counted by the metrics store) and on one that does not. One engine: the reference rows carry a zero
``logit_bias``, which leaves their logits as they are and keeps them from speculating."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_actors import LLM, SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
REPEATING = ("Copy the list exactly.\nList: red, green, blue, yellow, orange, purple, black, white.\n"
             "Copy: red, green, blue, yellow,")
PLAIN = "The capital of France is"


@pytest.fixture(scope="module")
def llm(default_gguf_path: str) -> Iterator[LLM]:
    spec = parse_speculative_config(NGRAM, adaptive=False)  # drafts whenever found: no timing in the test
    with LLM(dtype="float32", executor="inprocess", speculative_config=spec) as engine:
        yield engine


def test_greedy_ngram_equals_no_speculation_and_drafts_are_accepted(llm: LLM) -> None:
    speculating = SamplingParams(temperature=0.0, max_tokens=12)
    reference = SamplingParams(temperature=0.0, max_tokens=12, logit_bias={0: 0.0})  # does not speculate
    prompts = [REPEATING, PLAIN]
    outputs = llm.generate(prompts * 2, [speculating] * 2 + [reference] * 2, use_tqdm=False)
    tokens = [output.outputs[0].token_ids for output in outputs]
    assert tokens[:2] == tokens[2:]
    spec = llm.get_metrics().spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens <= spec.num_draft_tokens
