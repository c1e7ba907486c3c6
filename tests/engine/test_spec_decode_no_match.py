"""N-gram steps where the worker's lookup finds nothing: the request runs a plain decode row (no
filler drafts verified), counted as 0 drafted; a step where no request found a draft is a plain
step, which a deferring worker keeps in flight as any other. The outputs stay those without
speculation and the KV invariants hold after every step (the planned slots are rolled back)."""

from __future__ import annotations

import torch

from tests.engine.test_deferred_steps import DeferringFakeRunner, _new
from tests.engine.test_spec_decode import NGRAM, make_engine
from tests.engine.test_spec_decode import run as run_engine
from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.worker.ngram_drafts import NgramProposer
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.events import Finished, StepFinished, StepStarted
from vllm_actors.protocol.messages import StepPlan, StepResult
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import WORKER_DRAFT
from vllm_actors.runner.sampler import Sampler

FRESH = 200  # the fresh request's outputs: FRESH + its context length, never seen before


class HalfCopyingRunner(FakeRunner):
    """A request whose prompt starts with 1 repeats its context with period 3 (n-gram drafts are
    right); any other outputs tokens never seen before (the lookup finds nothing)."""

    def next_token(self, context: list[int]) -> int:
        return context[-3] if context[0] == 1 else FRESH + len(context)


def run(spec: dict[str, int | str] | None,
        prompts: list[list[int]]) -> tuple[dict[str, list[int]], list[object], FakeRunner]:
    runner = HalfCopyingRunner(num_blocks=32, block_size=4, vocab_size=512)
    engine, _ = make_engine(spec, runner=runner)
    events: list[object] = []
    engine.event_listeners.append(lambda batch: events.extend(batch.events))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return run_engine(engine, prompts, [params] * len(prompts)), events, runner


def test_a_request_without_ngram_matches_decodes_plain_rows_and_counts_nothing_drafted() -> None:
    prompts = [[5, 6, 7, 8, 9, 10]]
    expected = run(None, prompts)[0]
    outputs, events, runner = run(NGRAM, prompts)
    assert outputs == expected
    planned = [e for e in events if isinstance(e, StepStarted) and e.num_tokens == 1 + 4]  # 4 placeholders
    assert len(planned) > 10
    steps = [e for e in events if isinstance(e, StepFinished)]
    assert sum(step.num_draft_tokens + step.num_drafts for step in steps) == 0
    assert all(query_len == 1 for batch in runner.batches[1:] for query_len in batch.query_lens)  # no verification
    finished = next(e for e in events if isinstance(e, Finished))
    assert (finished.num_draft_tokens, finished.num_accepted_tokens) == (0, 0)


def test_a_mixed_batch_verifies_the_matching_request_and_decodes_the_other() -> None:
    prompts = [[1, 2, 3, 1, 2, 3, 1], [5, 6, 7, 8, 9]]
    expected = run(None, prompts)[0]
    outputs, events, runner = run(NGRAM, prompts)
    assert outputs == expected
    steps = [e for e in events if isinstance(e, StepFinished)]
    both = [step for step in steps if step.num_seqs == 2 and step.num_drafts]
    assert both and all(step.num_drafts == 1 for step in both)  # the fresh request drafted nowhere
    assert [1 + 4, 1] in [batch.query_lens for batch in runner.batches]  # its 4 drafts beside one row, no fillers
    assert sum(step.num_accepted_tokens for step in steps) > 0
    drafted = {e.request_id: e.num_draft_tokens for e in events if isinstance(e, Finished)}
    assert drafted["1"] == 0 and drafted["0"] > 0


def test_a_drafting_plan_left_without_drafts_is_launched_deferred() -> None:
    runner = DeferringFakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, defer=True,
                    drafter=NgramProposer(min_n=1, max_n=3))
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = [5, 6, 7]
    first = StepPlan(step_id=0, new_requests=[_new("a", prompt, greedy)], req_ids=["a"], num_tokens=[3],
                     num_blocks=[1], new_block_ids=[[0]])
    worker.handle(first)
    drafting = StepPlan(step_id=1, req_ids=["a"], num_tokens=[3], num_blocks=[2], new_block_ids=[[1]],
                        draft_token_ids={"a": [WORKER_DRAFT] * 2})
    outputs = worker.handle(drafting)
    assert [r.step_id for r in outputs.to(SCHEDULER)] == [0]  # step 0 read back; step 1 still in flight
    assert worker.has_pending()
    result = worker.flush().to(SCHEDULER)[0]
    assert isinstance(result, StepResult) and result.num_drafted == {"a": 0} and result.num_batched_tokens == 1
    assert worker.requests["a"].num_computed_tokens == len(prompt) + 1
    assert worker.requests["a"].token_ids == prompt + runner.reference(prompt, 2)


def test_hopeless_lookups_launch_before_the_step_in_flight_is_read_back() -> None:
    """With ``prompt_lookup_min`` 2, a context whose last token never occurred before cannot match
    whatever the pending token is: the drafting plan runs as a plain step launched while the step
    before is still in flight (its input taken on the device), not after reading it back."""
    runner = DeferringFakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0, defer=True,
                    drafter=NgramProposer(min_n=2, max_n=3))
    worker.pending_ready = lambda: False  # type: ignore[method-assign]  # a device still running step 0
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = [5, 6, 7]
    worker.handle(StepPlan(step_id=0, new_requests=[_new("a", prompt, greedy)], req_ids=["a"], num_tokens=[3],
                           num_blocks=[1], new_block_ids=[[0]]))
    drafting = StepPlan(step_id=1, req_ids=["a"], num_tokens=[3], num_blocks=[2], new_block_ids=[[1]],
                        draft_token_ids={"a": [WORKER_DRAFT] * 2})
    outputs = worker.handle(drafting)
    assert runner.num_deferred == 1  # launched before step 0 was read back
    assert [r.step_id for r in outputs.to(SCHEDULER)] == [0] and worker.has_pending()
    flushed = worker.flush()
    result = flushed.to(SCHEDULER)[0]
    assert isinstance(result, StepResult) and result.num_drafted == {"a": 0} and result.num_batched_tokens == 1
    assert [e.drained for e in flushed.events if isinstance(e, StepFinished)] == [False]  # stayed overlapped
    assert worker.requests["a"].token_ids == prompt + runner.reference(prompt, 2)
    repeating = [5, 6, 5]  # its last token occurred before: a lookup may match, so step 0 is read back first
    worker = Worker(DeferringFakeRunner(num_blocks=8, block_size=4), Sampler(torch.device("cpu")),
                    clock=lambda: 0.0, defer=True, drafter=NgramProposer(min_n=2, max_n=3))
    worker.pending_ready = lambda: False  # type: ignore[method-assign]
    worker.handle(StepPlan(step_id=0, new_requests=[_new("a", repeating, greedy)], req_ids=["a"], num_tokens=[3],
                           num_blocks=[1], new_block_ids=[[0]]))
    outputs = worker.handle(drafting).extend(worker.flush())
    assert worker.runner.num_deferred == 0  # type: ignore[attr-defined]
    # counted as drained (the metrics store's drained_steps): step 0 read back before step 1 launched
    assert [(e.step_id, e.drained) for e in outputs.events if isinstance(e, StepFinished)] == [(0, False), (1, True)]
