"""Speculative decoding (n-gram) on the embedded SmolLM2-135M (real weights, float32, in process):
greedy output identical to decoding without it, on a prompt that repeats text (drafts accepted,
counted by the metrics store) and on one that does not."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_actors import LLM, SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
REPEATING = ("Copy the list exactly.\nList: red, green, blue, yellow, orange, purple, black, white.\n"
             "Copy: red, green, blue, yellow,")
PLAIN = "The capital of France is"
PARAMS = SamplingParams(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def engines(default_gguf_path: str) -> Iterator[tuple[LLM, LLM]]:
    spec = parse_speculative_config(NGRAM, adaptive=False)  # drafts whenever found: no timing in the test
    with LLM(dtype="float32", executor="inprocess") as plain, \
            LLM(dtype="float32", executor="inprocess", speculative_config=spec) as speculating:
        yield plain, speculating


def test_greedy_ngram_equals_no_speculation_and_drafts_are_accepted(engines: tuple[LLM, LLM]) -> None:
    plain, speculating = engines
    expected = [o.outputs[0].token_ids for o in plain.generate([REPEATING, PLAIN], PARAMS, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in speculating.generate([REPEATING, PLAIN], PARAMS, use_tqdm=False)]
    assert got == expected
    spec = speculating.get_metrics().spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens <= spec.num_draft_tokens
    assert plain.get_metrics().spec_decode.num_drafts == 0
