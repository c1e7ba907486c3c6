"""Speculative decoding (n-gram) on the embedded SmolLM2-135M (real weights, float32, in process):
greedy output identical to decoding without it, on a prompt that repeats text (drafts accepted,
counted by the metrics store) and on one that does not. One engine: the reference rows carry a zero
``logit_bias``, which leaves their logits as they are and keeps them from speculating."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


def test_rows_after_a_verification_in_flight_move_on_the_device(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the device kept busy (as on a GPU), the step after a verification is launched before its
    read-back, each drafting request's row moved by its accepted count (``spec_overlap``): the
    greedy tokens of no speculation, and no KV block left behind."""
    from vllm_actors.actors.worker.step_data import PendingStep
    from vllm_actors.clients.inprocess import InProcessEngine
    from vllm_actors.protocol.events import StepFinished

    monkeypatch.setattr(PendingStep, "ready", lambda self: False)
    engine = llm.engine
    assert isinstance(engine, InProcessEngine)
    worker: Any = engine.worker
    monkeypatch.setattr(worker, "spec_overlap", worker.defer and worker.runner.supports_overlap_rows)  # off by default
    steps: list[StepFinished] = []
    listener = lambda batch: steps.extend(e for e in batch.events if isinstance(e, StepFinished))  # noqa: E731
    engine.event_listeners.append(listener)
    engine.step_hooks.append(InProcessEngine.check_invariants)
    try:
        speculating = SamplingParams(temperature=0.0, max_tokens=16)
        reference = SamplingParams(temperature=0.0, max_tokens=16, logit_bias={0: 0.0})  # does not speculate
        prompts = [REPEATING, PLAIN]
        outputs = llm.generate(prompts * 2, [speculating] * 2 + [reference] * 2, use_tqdm=False)
    finally:
        engine.event_listeners.remove(listener)
        engine.step_hooks.remove(InProcessEngine.check_invariants)
    tokens = [output.outputs[0].token_ids for output in outputs]
    assert tokens[:2] == tokens[2:]
    assert sum(step.overlapped for step in steps) > 0 and sum(step.num_accepted_tokens for step in steps) > 0
    engine.check_idle_invariants()
