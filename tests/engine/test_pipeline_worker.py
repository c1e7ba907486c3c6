"""A pipeline stage's worker as a state machine (a fake runner, no process): a stage before the
last runs its part of each step, answers nothing and reports its part with its stage; it takes a
decoding request's input token from the plan and holds no grammar or penalty counts (it draws
nothing); the last stage samples and answers as before."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.worker.ranks import OnlyStage
from vllm_actors.actors.worker.step_data import RowGrammar
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.events import StepFinished
from vllm_actors.protocol.messages import NewRequest, StepPlan, StepResult
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams, StructuredOutputs
from vllm_actors.protocol.token_ids import pack_token_ids
from vllm_actors.runner.sampler import Sampler

PROMPT = [5, 6, 7]


def _plans() -> tuple[StepPlan, StepPlan]:
    new = NewRequest(request_id="a", token_ids=pack_token_ids(PROMPT), num_prompt_tokens=3, num_output_tokens=0,
                     params=SamplingParams(temperature=0.0, max_tokens=4), eos_token_ids=[])
    prefill = StepPlan(step_id=0, new_requests=[new], req_ids=["a"], num_tokens=[3], num_blocks=[1],
                       new_block_ids=[[0]])
    decode = StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[1], new_block_ids=[[]],
                      input_token_ids={"a": 42})
    return prefill, decode


def test_an_earlier_stage_answers_nothing_and_takes_its_input_token_from_the_plan() -> None:
    runner = FakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, stage=OnlyStage(stage=0, is_last=False))
    prefill, decode = _plans()
    outputs = worker.handle(prefill)
    assert outputs.to(SCHEDULER) == []
    (finished,) = [event for event in outputs.events if isinstance(event, StepFinished)]
    assert (finished.step_id, finished.stage, finished.num_sampled) == (0, 0, 0)
    assert worker.handle(decode).to(SCHEDULER) == []
    assert runner.batches[-1].token_ids == [42] and runner.batches[-1].positions == [3]
    assert worker.requests["a"].token_ids == [*PROMPT, 42]


def test_the_last_stage_samples_and_keeps_its_own_token() -> None:
    runner = FakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, stage=OnlyStage(stage=1, is_last=True))
    prefill, decode = _plans()
    (first,) = worker.handle(prefill).to(SCHEDULER)
    assert isinstance(first, StepResult) and first.req_ids == ["a"]
    sampled = first.token_ids[0]
    decode.input_token_ids = {"a": sampled}
    outputs = worker.handle(decode)
    assert runner.batches[-1].token_ids == [sampled]  # not appended twice
    assert worker.requests["a"].token_ids[:4] == [*PROMPT, sampled] and len(worker.requests["a"].token_ids) == 5
    assert all(event.stage is None for event in outputs.events if isinstance(event, StepFinished))


class _NoGrammars:
    """A grammar source that must not be asked: a stage before the last draws nothing."""

    def start(self, spec: StructuredOutputs, replay: Sequence[int] = ()) -> RowGrammar:
        raise AssertionError("an earlier stage compiled a grammar")

    def mask(self, logits: torch.Tensor, rows: Sequence[Any], row_index: list[int],
             drafted: Sequence[Sequence[int]] | None = None) -> None:
        raise AssertionError("an earlier stage masked logits")


def test_an_earlier_stage_keeps_no_grammar_and_no_penalty_counts() -> None:
    runner = FakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, grammars=_NoGrammars(),
                    stage=OnlyStage(stage=0, is_last=False))
    prefill, _ = _plans()
    params = SamplingParams(temperature=0.0, max_tokens=4, repetition_penalty=1.5,
                            structured_outputs=StructuredOutputs(regex="[0-9]+"))
    prefill.new_requests = [msgspec.structs.replace(prefill.new_requests[0], params=params)]
    assert worker.handle(prefill).to(SCHEDULER) == []
    request = worker.requests["a"]
    assert request.grammar is None and request.penalty_slot == -1
