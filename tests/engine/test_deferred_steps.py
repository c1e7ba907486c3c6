"""Deferred steps (actors/worker/worker.py): a worker launches step N+1 before reading step N's
tokens back, the pending tokens taken from step N's sampled ids on the device. The fake runner
(tests/support/fake_runner.py) turns any wrong input token, slot or block table into different outputs,
so greedy outputs equal to the reference mean every placeholder was filled with the right token."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from tests.engine.test_scheduler import make_engine, run
from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.worker.host_copies import HostCopies
from vllm_actors.actors.worker.step_data import BatchInput, PendingStep
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.messages import NewRequest, StepPlan
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids
from vllm_actors.runner.sampler import Sampler


@dataclass
class DeferringFakeRunner(FakeRunner):
    """The fake runner taking deferred input ids as the model runner does: from the device tensor."""

    supports_deferred_inputs = True
    num_deferred: int = 0

    def execute(self, batch: BatchInput) -> torch.Tensor:
        if batch.deferred is not None:
            token_ids = list(batch.token_ids)
            sampled = batch.deferred.source.tolist()
            for index, row in zip(batch.deferred.flat_index, batch.deferred.source_row, strict=True):
                assert token_ids[index] == 0  # a placeholder
                token_ids[index] = sampled[row]
            self.num_deferred += len(batch.deferred.flat_index)
            batch = BatchInput(
                token_ids, batch.positions, batch.query_lens, batch.seq_lens, batch.block_tables,
                batch.logits_indices, batch.block_table_array,
            )
        return super().execute(batch)


def _new(request_id: str, prompt: list[int], params: SamplingParams) -> NewRequest:
    return NewRequest(
        request_id=request_id,
        token_ids=pack_token_ids(prompt),
        num_prompt_tokens=len(prompt),
        num_output_tokens=0,
        params=params,
        eos_token_ids=[],
    )


@pytest.fixture
def busy_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU a step is done when launched; make it look still running (as on a busy GPU), so
    that the next plan is launched before it is read back."""
    monkeypatch.setattr(PendingStep, "ready", lambda self: False)


def test_a_plan_launched_while_the_previous_step_is_pending_reads_its_token_on_the_device(busy_device: None) -> None:
    runner = DeferringFakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, defer=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = [5, 6, 7]
    first = StepPlan(step_id=0, new_requests=[_new("a", prompt, greedy)], req_ids=["a"], num_tokens=[3],
                     num_blocks=[1], new_block_ids=[[0]])
    assert not worker.handle(first)  # launched; nothing read back yet
    assert worker.has_pending() and not worker.pending_ready()
    second = StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[1], new_block_ids=[[]])
    outputs = worker.handle(second)  # launched on the pending token, then step 0 read back
    results = outputs.to(SCHEDULER)
    assert [r.step_id for r in results] == [0] and runner.num_deferred == 1
    last = worker.flush().to(SCHEDULER)
    assert [r.step_id for r in last] == [1]
    assert results[0].token_ids + last[0].token_ids == runner.reference(prompt, 2)
    assert worker.requests["a"].token_ids == prompt + runner.reference(prompt, 2)
    assert not worker.has_pending() and not worker.flush()


def test_a_step_already_done_is_read_back_before_the_next_is_launched() -> None:
    runner = DeferringFakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, defer=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    first = StepPlan(step_id=0, new_requests=[_new("a", [5, 6, 7], greedy)], req_ids=["a"], num_tokens=[3],
                     num_blocks=[1], new_block_ids=[[0]])
    assert not worker.handle(first) and worker.pending_ready()  # on a CPU: done at once
    second = StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[1], new_block_ids=[[]])
    outputs = worker.handle(second)
    assert [m.step_id for m in outputs.to(SCHEDULER)] == [0]
    assert runner.num_deferred == 0  # the token was on the host before step 1 was prepared


class _DeviceRunner(DeferringFakeRunner):
    """Its steps run on a device other than the host: a step that draws nothing returns its (empty)
    logits there ("meta" stands for the GPU)."""

    def execute(self, batch: BatchInput) -> torch.Tensor:
        logits = super().execute(batch)
        return logits if logits.shape[0] else torch.empty((0, self.vocab_size), device="meta")


def test_a_prefill_chunk_that_draws_nothing_is_fenced_until_the_device_has_run_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A deferred step's result lets the scheduler plan the step after next, whose inputs refill this
    step's pinned staging buffers: a chunk that draws no token is read back only once the device has
    run it, as a step that draws is (else a long prefill's host runs chunks ahead of the GPU and
    overwrites the inputs of chunks still queued)."""
    device_done = False

    class DeviceEvent:
        def query(self) -> bool:
            return device_done

        def synchronize(self) -> None:
            assert device_done, "read back before the device ran the step"

    def start(self: HostCopies, chosen: torch.Tensor) -> tuple[torch.Tensor, DeviceEvent | None]:
        return (chosen, None) if chosen.device.type == "cpu" else (torch.empty(0, dtype=torch.long), DeviceEvent())

    monkeypatch.setattr(HostCopies, "start", start)
    worker = Worker(_DeviceRunner(num_blocks=8, block_size=4), Sampler(torch.device("cpu")), clock=lambda: 0.0,
                    defer=True)
    prompt = list(range(1, 13))
    chunk = StepPlan(step_id=0, new_requests=[_new("a", prompt, SamplingParams(temperature=0.0, max_tokens=4))],
                     req_ids=["a"], num_tokens=[4], num_blocks=[1], new_block_ids=[[0]])
    assert not worker.handle(chunk)
    assert worker.has_pending() and not worker.pending_ready()  # the shell holds the result back
    device_done = True
    assert worker.pending_ready()
    (result,) = worker.flush().to(SCHEDULER)
    assert result.step_id == 0 and result.token_ids == [] and worker.requests["a"].num_computed_tokens == 4


def test_logprobs_rows_are_not_deferred() -> None:
    runner = DeferringFakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, defer=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    plan = StepPlan(step_id=0, new_requests=[_new("a", [1, 2], params)], req_ids=["a"], num_tokens=[2],
                    num_blocks=[1], new_block_ids=[[0]])
    outputs = worker.handle(plan)  # read back at once: its logprobs travel with the tokens
    assert [m.step_id for m in outputs.to(SCHEDULER)] == [0]
    assert not worker.has_pending()


@pytest.mark.parametrize("budget,num_blocks", [(64, 200), (16, 40)])  # roomy; chunked prefill + preemption
def test_deferred_engine_is_token_identical_to_the_reference(
    budget: int, num_blocks: int, monkeypatch: pytest.MonkeyPatch, busy_device: None
) -> None:
    monkeypatch.setenv("VLLM_ACTORS_DEFER_STEPS", "1")
    engine, _ = make_engine(num_blocks=num_blocks, budget=budget, serialize=False)
    runner = DeferringFakeRunner(num_blocks=num_blocks, block_size=4)
    engine.worker.runner = runner  # the same worker, now deferring (make_engine's runner cannot)
    engine.worker.defer = True
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randrange(3, 40))] for _ in range(12)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(5, 30), ignore_eos=True) for _ in prompts]
    finished = run(engine, prompts, params)
    for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        output = finished[str(index)]
        assert output.outputs[0].token_ids == runner.reference(prompt, p.max_tokens or 0), index  # type: ignore[attr-defined]
    assert runner.num_deferred > 0  # the path under test was taken


def test_penalised_rows_are_deferred_and_match_the_penalty_formulas(
    monkeypatch: pytest.MonkeyPatch, busy_device: None
) -> None:
    """Penalties read the device's counts (PenaltyPool), not the lagging token lists: steps with
    penalised rows are launched before the previous one is read back, and every greedy output is
    the one vLLM's formulas give over the whole history (including requests preempted and resumed)."""
    from tests.models.test_sampling_controls import reference

    monkeypatch.setenv("VLLM_ACTORS_DEFER_STEPS", "1")
    engine, _ = make_engine(num_blocks=40, budget=16, serialize=False)
    runner = DeferringFakeRunner(num_blocks=40, block_size=4)
    engine.worker.runner = runner
    engine.worker.defer = True
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 97) for _ in range(rng.randrange(3, 30))] for _ in range(10)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(10, 40), ignore_eos=True,
                             frequency_penalty=rng.choice([0.0, 2.0, -2.0]), presence_penalty=rng.choice([0.0, -2.0]),
                             repetition_penalty=rng.choice([1.0, 20.0]))
              for _ in prompts]
    finished = run(engine, prompts, params)
    changed = 0
    for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        generated: list[int] = []
        for _ in range(p.max_tokens or 0):
            logits = torch.zeros(runner.vocab_size)
            logits[runner.next_token(prompt + generated)] = 10.0
            generated.append(int(reference(logits, p, prompt, generated).argmax()))
        assert finished[str(index)].outputs[0].token_ids == generated, index  # type: ignore[attr-defined]
        changed += generated != runner.reference(prompt, p.max_tokens or 0)
    assert runner.num_deferred > 0 and changed  # deferred, and the penalties changed some outputs


@dataclass
class _FollowerRanks:
    """Rank 1 of 2: each broadcast hands over the ids rank 0 drew (here: scripted)."""

    drawn: list[list[int]]
    rank: int = 1
    size: int = 2
    enabled: bool = True

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        x.copy_(torch.tensor(self.drawn.pop(0)))
        return x


@pytest.mark.parametrize("defer", [False, True])
def test_a_follower_rank_appends_the_ids_rank_0_drew_and_answers_nothing(defer: bool, busy_device: None) -> None:
    """The same step body on a rank above 0, read back at once or deferred: no draw of its own, no
    result or event (rank 0 answers), its requests' next inputs the broadcast ids."""
    runner = DeferringFakeRunner(num_blocks=8, block_size=8, tp=_FollowerRanks([[11, 12], [13, 14], [15, 16]]))
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, defer=defer)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    plans = [StepPlan(step_id=0, new_requests=[_new("a", [5, 6, 7], greedy), _new("b", [8, 9], greedy)],
                      req_ids=["a", "b"], num_tokens=[3, 2], num_blocks=[1, 1], new_block_ids=[[0], [1]])]
    plans += [StepPlan(step_id=step, req_ids=["a", "b"], num_tokens=[1, 1], num_blocks=[1, 1],
                       new_block_ids=[[], []]) for step in (1, 2)]
    for plan in plans:
        assert not worker.handle(plan)
    assert worker.has_pending() == defer and not worker.flush()
    assert worker.requests["a"].token_ids == [5, 6, 7, 11, 13, 15]
    assert worker.requests["b"].token_ids == [8, 9, 12, 14, 16]
    assert runner.num_deferred == (4 if defer else 0)  # deferred: each decode's inputs taken on the device
