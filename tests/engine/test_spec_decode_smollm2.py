"""Speculative decoding (n-gram) on the embedded SmolLM2-135M (real weights, float32, in process):
greedy output identical to decoding without it (a second engine, not speculating), on a prompt that
repeats text (drafts accepted, counted by the metrics store) and on one that does not; rows with
logits controls and structured outputs speculate too (their drafts cut where the grammar refuses
them) and keep the outputs of no speculation."""

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


@pytest.fixture(scope="module")
def plain(default_gguf_path: str) -> Iterator[LLM]:
    """The reference: the same model without speculation."""
    with LLM(dtype="float32", executor="inprocess") as engine:
        yield engine


def tokens_of(engine: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in engine.generate(prompts, params, use_tqdm=False)]


def test_greedy_ngram_equals_no_speculation_and_drafts_are_accepted(llm: LLM, plain: LLM) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=12)] * 2
    prompts = [REPEATING, PLAIN]
    assert tokens_of(llm, prompts, params) == tokens_of(plain, prompts, params)
    spec = llm.get_metrics().spec_decode
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens <= spec.num_draft_tokens


def test_rows_after_a_verification_in_flight_move_on_the_device(llm: LLM, plain: LLM,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """With the device kept busy (as on a GPU), the step after a verification is launched before its
    read-back, each drafting request's row moved by its accepted count (``spec_overlap``); a
    penalised row's verification is read back at once beside them: the greedy tokens of no
    speculation, and no KV block left behind."""
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
        penalised = SamplingParams(temperature=0.0, max_tokens=16, frequency_penalty=0.2)
        prompts = [REPEATING, PLAIN] * 2
        params = [speculating] * 2 + [penalised] * 2
        tokens = tokens_of(llm, prompts, params)
    finally:
        engine.event_listeners.remove(listener)
        engine.step_hooks.remove(InProcessEngine.check_invariants)
    assert tokens == tokens_of(plain, prompts, params)
    assert sum(step.overlapped for step in steps) > 0 and sum(step.num_accepted_tokens for step in steps) > 0
    engine.check_idle_invariants()


def test_constrained_and_penalised_rows_speculate_with_the_outputs_of_no_speculation(llm: LLM, plain: LLM) -> None:
    """A regex the copy satisfies in part (drafts past where it stops are cut before verification),
    a choice, and logits controls (penalties, bias, bad words) on the repeating prompt: the tokens
    of no speculation, with drafts made and accepted for these rows."""
    from vllm_actors.protocol.sampling import StructuredOutputs

    colour = "(red|green|blue|yellow|orange|purple|black|white)"
    params = [
        SamplingParams(temperature=0.0, max_tokens=14,
                       structured_outputs=StructuredOutputs(regex=f" {colour}(, {colour}){{0,3}}\\.")),
        SamplingParams(temperature=0.0, max_tokens=8,
                       structured_outputs=StructuredOutputs(choice=[" orange, purple, black, white.", " none"])),
        SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.05, frequency_penalty=0.1,
                       logit_bias={11: 1.0}, bad_words=[" grey"]),
    ]
    prompts = [REPEATING] * len(params)
    before = llm.get_metrics().spec_decode
    got = tokens_of(llm, prompts, params)
    after = llm.get_metrics().spec_decode
    assert got == tokens_of(plain, prompts, params)
    assert after.num_accepted_tokens > before.num_accepted_tokens
    assert after.num_draft_tokens > before.num_draft_tokens
