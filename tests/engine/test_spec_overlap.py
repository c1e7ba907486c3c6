"""A plain step launched before the n-gram verification in flight is read back
(``actors/worker/spec_overlap.py``): each drafting request's row moved on the device by its
accepted count. Outputs equal decoding without speculation (greedy; seeded rows fall back to the
read-back first), the overlapped path is taken (``StepFinished.overlapped``), and the KV invariants
hold after every step. The device is kept busy (``PendingStep.ready`` False), as on a GPU."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_deferred_steps import _new
from tests.engine.test_spec_decode import NGRAM, PROMPTS, CopyingRunner, make_engine, run
from tests.engine.test_spec_decode_no_match import HalfCopyingRunner
from tests.support.overlap_runner import OverlapFakeRunner
from vllm_actors.actors.worker.ngram_drafts import NgramProposer
from vllm_actors.actors.worker.spec_overlap import accepted_counts
from vllm_actors.actors.worker.step_data import PendingStep
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.events import StepFinished
from vllm_actors.protocol.messages import StepPlan, StepResult
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import WORKER_DRAFT
from vllm_actors.runner.sampler import Sampler


class OverlapCopying(OverlapFakeRunner, CopyingRunner):
    pass


class OverlapHalfCopying(OverlapFakeRunner, HalfCopyingRunner):
    pass


@pytest.fixture
def busy_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PendingStep, "ready", lambda self: False)
    monkeypatch.setenv("VLLM_ACTORS_SPEC_OVERLAP", "1")  # off by default until measured on a GPU


def test_accepted_counts_stop_at_the_first_mismatch() -> None:
    # three samplers: 2 drafts both right, a plain row, 3 drafts of which the second is wrong
    drafts = [[7, 8], [], [4, 5, 6]]
    chosen = torch.tensor([7, 8, 9, 11, 4, 1, 6, 2])
    assert accepted_counts(chosen, drafts).tolist() == [2, 0, 1]
    assert accepted_counts(torch.tensor([1, 9, 9, 9]), [[2, 9, 9]]).tolist() == [0]  # all rejected


def overlap_run(spec: dict[str, int | str] | None, runner: OverlapFakeRunner, prompts: list[list[int]],
                params: list[SamplingParams]) -> tuple[dict[str, list[int]], list[StepFinished]]:
    engine, steps = make_engine(spec, runner=runner)
    return run(engine, prompts, params), steps


@pytest.mark.parametrize("num_blocks", [64, 18], ids=["roomy", "preempting"])
def test_greedy_outputs_equal_no_speculation_with_rows_moved_on_the_device(busy_device: None, num_blocks: int) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=30 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    expected, _ = overlap_run(None, OverlapCopying(num_blocks=num_blocks, block_size=4), PROMPTS, params)
    runner = OverlapCopying(num_blocks=num_blocks, block_size=4)
    outputs, steps = overlap_run(NGRAM, runner, PROMPTS, params)
    assert outputs == expected
    assert sum(step.overlapped for step in steps) > 10 and runner.num_moved == sum(s.overlapped for s in steps)
    accepted = sum(step.num_accepted_tokens for step in steps)
    assert 0 < accepted < sum(step.num_draft_tokens for step in steps)  # drafts both accepted and rejected


def test_single_requests_whose_drafts_are_all_rejected_all_accepted_or_partly(busy_device: None) -> None:
    """One request per engine: each verifying step's counts are its own."""
    seen = {"none": 0, "all": 0, "part": 0}
    for index, prompt in enumerate(PROMPTS):
        params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
        expected, _ = overlap_run(None, OverlapCopying(num_blocks=64, block_size=4), [prompt], params)
        outputs, steps = overlap_run(NGRAM, OverlapCopying(num_blocks=64, block_size=4), [prompt], params)
        assert outputs == expected, index
        for step, after in zip(steps, steps[1:], strict=False):
            if step.num_drafts and after.overlapped:  # the row after it moved by its accepted count
                kind = "none" if not step.num_accepted_tokens else \
                    "all" if step.num_accepted_tokens == step.num_draft_tokens else "part"
                seen[kind] += 1
    assert all(seen.values()), seen


def test_copying_requests_accept_every_draft_and_fresh_ones_find_none(busy_device: None) -> None:
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 7, 8, 9, 10]]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * 2
    expected, _ = overlap_run(None, OverlapHalfCopying(num_blocks=32, block_size=4, vocab_size=512), prompts, params)
    outputs, steps = overlap_run(NGRAM, OverlapHalfCopying(num_blocks=32, block_size=4, vocab_size=512), prompts,
                                 params)
    assert outputs == expected
    drafting = [step for step in steps if step.num_drafts]
    assert drafting and all(step.num_accepted_tokens == step.num_draft_tokens for step in drafting)
    assert sum(step.overlapped for step in steps) > 0


def test_requests_finishing_inside_an_accepted_run(busy_device: None) -> None:
    """Stop ids, EOS and max_tokens reached among a verification's accepted tokens: the plain row
    already launched after it is dropped, as the stop's tokens past it are."""
    params = [SamplingParams(temperature=0.0, max_tokens=9 + 3 * i, min_tokens=2, stop_token_ids=[PROMPTS[i][2]])
              for i in range(len(PROMPTS))]
    params += [SamplingParams(temperature=0.0, max_tokens=50)]  # EOS (token 0 of the fake model)
    prompts = [*PROMPTS, [0, 3, 4, 0, 3, 4, 0, 3]]
    expected, _ = overlap_run(None, OverlapCopying(num_blocks=64, block_size=4), prompts, params)
    outputs, steps = overlap_run(NGRAM, OverlapCopying(num_blocks=64, block_size=4), prompts, params)
    assert outputs == expected
    assert sum(step.overlapped for step in steps) > 0 and sum(step.num_accepted_tokens for step in steps) > 0


def test_seeded_rows_replay_their_tokens_by_reading_the_verification_back_first(busy_device: None) -> None:
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=30 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    expected, _ = overlap_run(None, OverlapCopying(num_blocks=64, block_size=4), PROMPTS, params)
    outputs, steps = overlap_run(NGRAM, OverlapCopying(num_blocks=64, block_size=4), PROMPTS, params)
    assert outputs == expected
    assert sum(step.num_accepted_tokens for step in steps) > 0


def test_the_setting_off_reads_every_verification_back_at_once(busy_device: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_SPEC_OVERLAP", "0")
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 2
    outputs, steps = overlap_run(NGRAM, OverlapCopying(num_blocks=64, block_size=4), PROMPTS[:2], params)
    assert outputs == overlap_run(None, OverlapCopying(num_blocks=64, block_size=4), PROMPTS[:2], params)[0]
    assert sum(step.num_drafts for step in steps) > 0 and not any(step.overlapped for step in steps)


class BreaksAtTen(OverlapFakeRunner):
    """Copies its context with period 3, except after 10 tokens (50): n-gram drafts of a period-3
    prompt are right up to there."""

    def next_token(self, context: list[int]) -> int:
        return 50 if len(context) == 10 else context[-3]


def test_the_row_after_a_verification_moves_back_by_its_rejected_drafts(busy_device: None) -> None:
    """The worker alone: a verification of 3 drafts (the first two right, the third wrong) still in
    flight when the next plan comes; that plan's placeholders are dropped (drafted 0) and the
    request's row runs at the position after its kept tokens, its input the target's draw there."""
    runner = BreaksAtTen(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, defer=True,
                    drafter=NgramProposer(min_n=1, max_n=3))
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    prompt = [1, 2, 3, 1, 2, 3, 1]
    worker.handle(StepPlan(step_id=0, new_requests=[_new("a", prompt, greedy)], req_ids=["a"], num_tokens=[7],
                           num_blocks=[2], new_block_ids=[[0, 1]]))
    worker.flush()
    assert worker.requests["a"].token_ids == [*prompt, 2]
    drafting = StepPlan(step_id=1, req_ids=["a"], num_tokens=[4], num_blocks=[3], new_block_ids=[[2]],
                        draft_token_ids={"a": [WORKER_DRAFT] * 3})
    assert not worker.handle(drafting).to(SCHEDULER)  # launched, its verification still in flight
    assert worker._pending is not None and worker._pending.verifying == [[3, 1, 2]]
    # planned as if all 3 were accepted: position 7 + 3 + 1 = 11 and 2 drafts more; it runs at 7 + 2 + 1
    following = StepPlan(step_id=2, req_ids=["a"], num_tokens=[3], num_blocks=[4], new_block_ids=[[3]],
                         draft_token_ids={"a": [WORKER_DRAFT] * 2})
    result = worker.handle(following).to(SCHEDULER)[0]
    assert isinstance(result, StepResult) and result.step_id == 1 and result.token_ids == [3, 1, 50]
    assert worker.num_overlapped_steps == 1 and runner.num_moved == 1
    assert runner.batches[-1].positions == [10] and runner.batches[-1].token_ids == [50]  # moved back by 1
    last = worker.flush()
    second = last.to(SCHEDULER)[0]
    assert isinstance(second, StepResult) and second.num_drafted == {"a": 0} and second.num_batched_tokens == 1
    assert second.overlapped_ids == ["a"]  # dropped for the verification in flight, not found wanting
    assert second.token_ids == [runner.next_token([*prompt, 2, 3, 1, 50])]
    assert [e.overlapped for e in last.events if isinstance(e, StepFinished)] == [1]
    request = worker.requests["a"]
    assert request.token_ids == [*prompt, 2, 3, 1, 50, second.token_ids[0]]
    assert request.num_computed_tokens == len(request.token_ids) - 1 and request.num_pending == 0
    assert request.num_output_tokens == 5


def test_placeholders_dropped_for_a_verification_in_flight_are_no_failed_lookup() -> None:
    """The scheduler rolls the dropped placeholders back either way, but only a lookup that found
    nothing counts as a wrong draft (``StepResult.overlapped_ids``: the row ran before the
    verification's read-back)."""
    from tests.state_machines.spec_sim import new_speculator
    from vllm_actors.actors.scheduler.request import ScheduledRequest, Status

    alphas = {}
    for overlapped in ([], ["a"]):
        spec, _ = new_speculator(adaptive=False)
        params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
        request = ScheduledRequest("a", list(range(20)), params, [], output_token_ids=[1], num_computed_tokens=24,
                                   status=Status.RUNNING, in_worker=True, num_pending_drafts=4)
        before = spec._pace("a").acceptance.alpha
        plan = StepPlan(step_id=3, req_ids=["a"], num_tokens=[5], num_blocks=[2], new_block_ids=[[]],
                        draft_token_ids={"a": [WORKER_DRAFT] * 4})
        result = StepResult(step_id=3, req_ids=["a"], token_ids=[7], num_drafted={"a": 0}, overlapped_ids=overlapped)
        spec.account(plan, result, {"a": request})
        assert request.num_computed_tokens == 20 and request.num_pending_drafts == 0  # rolled back either way
        alphas[bool(overlapped)] = (before, spec._pace("a").acceptance.alpha)
    assert alphas[True][1] == alphas[True][0] and alphas[False][1] < alphas[False][0]
