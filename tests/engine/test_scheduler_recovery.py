"""The scheduler's side of recovery, driven directly: a new scheduler's first plan resets the
pipeline; ``RecoverPipeline`` preempts what runs and resumes it by recompute; resubmissions
(``AddRequest.resume`` with the tokens the client received) resume, finish at once or are refused;
results of plans from before a reset are ignored."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.scheduler_messages import add, events_of, ignored, plans_of, result_of, scheduler, updates_of
from vllm_actors.protocol.events import Finished, PipelineReset, Preempted, Queued, Resumed
from vllm_actors.protocol.messages import AddRequest, NewRequest, RecoverPipeline, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER, WORKER, child_request_id
from vllm_actors.protocol.sampling import SamplingParams


def test_a_new_schedulers_first_plan_resets_the_pipeline_and_only_that_one() -> None:
    s = scheduler()
    first, second = plans_of(s.handle(add("a", [1, 2, 3])))  # the prefill, then the next decode
    assert first.reset and not second.reset
    (third,) = plans_of(s.handle(result_of(first)))
    assert not third.reset


def test_recover_pipeline_preempts_running_requests_in_order_and_keeps_waiting_ones() -> None:
    s = scheduler(max_num_seqs=3, max_steps_in_flight=1)
    (plan0,) = plans_of(s.handle(add("a", [1] * 9)))
    for request_id in ("b", "c", "d"):
        s.handle(add(request_id, [2] * 6 + [ord(request_id)]))
    (plan1,) = plans_of(s.handle(result_of(plan0)))  # a decodes; b and c join; d waits (max_num_seqs)
    assert [r.request_id for r in s.running] == ["a", "b", "c"] and [r.request_id for r in s.waiting] == ["d"]
    out = s.handle(RecoverPipeline(actor=WORKER, reason="hung"))
    preempted = events_of(out, Preempted)
    assert [e.request_id for e in preempted] == ["a", "b", "c"]
    assert events_of(out, PipelineReset) == [PipelineReset(reason="worker: hung", num_preempted=3)]
    (plan2,) = plans_of(out)
    assert plan2.reset and plan2.step_id > plan1.step_id and not plan2.finished_ids and not plan2.evicted_hashes
    # Resumed by recompute, in their order: prompt and outputs, from the first token.
    news = {new.request_id: new for new in plan2.new_requests}
    assert [new.request_id for new in plan2.new_requests] == ["a", "b", "c"]
    assert news["a"].token_list() == [1] * 9 + [5] and news["a"].num_output_tokens == 1
    assert news["a"].num_cached_tokens == 0  # the prefix cache is empty: its blocks are gone
    assert [r.request_id for r in s.waiting] == ["d"]
    assert {r.request_id: r.num_pending for r in s.requests.values()} == {"a": 1, "b": 1, "c": 1, "d": 0}
    # The stale result of plan 1 (and a reset-less one for plan 2) are ignored, not errors.
    assert ignored(s.handle(result_of(plan1)))
    assert ignored(s.handle(StepResult(step_id=plan2.step_id, req_ids=[], token_ids=[])))
    assert s.stats.num_stale_results == 2
    out = s.handle(result_of(plan2, token=7))
    assert {u.request_id: u.new_token_ids for u in updates_of(out)} == {"a": [7], "b": [7], "c": [7]}
    s.ledger.check_invariants({r.request_id for r in s.running})


def test_a_request_whose_token_is_in_flight_at_the_reset_samples_it_again() -> None:
    s = scheduler(max_steps_in_flight=2)
    plan0, plan1 = plans_of(s.handle(add("a", [1, 2, 3, 4, 5])))  # plan 1 samples its second token
    (plan2,) = plans_of(s.handle(result_of(plan0)))  # and plan 2 its third
    assert s.requests["a"].num_pending == 2 and s.requests["a"].output_token_ids == [5]
    plan3, plan4 = plans_of(s.handle(RecoverPipeline(actor=KV_CACHE_MANAGER, reason="exited")))
    request = s.requests["a"]
    assert plan3.reset and not plan4.reset and plan4.req_ids == ["a"] and not plan4.new_requests
    assert request.num_pending == 2 and request.output_token_ids == [5]  # plans 3 and 4, not 1 and 2
    assert plan3.new_requests[0].token_list() == [1, 2, 3, 4, 5, 5]  # the lost tokens are not there
    assert ignored(s.handle(result_of(plan1))) and ignored(s.handle(result_of(plan2)))
    out = s.handle(result_of(plan3, token=9))
    assert [u.new_token_ids for u in updates_of(out)] == [[9]] and request.output_token_ids == [5, 9]


def test_a_reset_in_the_middle_of_a_chunked_prefill_starts_it_over() -> None:
    s = scheduler(max_num_batched_tokens=8, max_steps_in_flight=1)
    (plan0,) = plans_of(s.handle(add("a", list(range(1, 21)))))
    assert plan0.num_tokens == [8]
    (plan1,) = plans_of(s.handle(StepResult(step_id=plan0.step_id, reset=True, req_ids=[], token_ids=[])))
    out = s.handle(RecoverPipeline(actor=WORKER, reason="exited"))
    assert [e.num_computed_tokens for e in events_of(out, Preempted)] == [16]
    (plan2,) = plans_of(out)
    assert plan2.reset and plan2.num_tokens == [8] and plan2.new_requests[0].num_output_tokens == 0


def test_n2_children_are_preempted_and_resumed_each_on_its_own() -> None:
    s = scheduler()
    for index in range(2):
        s.handle(add(child_request_id("r", index), [3, 4, 5], seed=7 + index, temperature=1.0))
    plan = plans_of(s.handle(RecoverPipeline(actor=WORKER, reason="exited")))[0]
    assert plan.reset and {n.request_id for n in plan.new_requests} == {"r#0", "r#1"}


def test_a_resubmission_resumes_with_its_outputs_counted_for_seeded_sampling() -> None:
    s = scheduler()
    out = s.handle(add("a", [1, 2, 3], outputs=[7, 8], seed=3, temperature=1.0))
    plan = plans_of(out)[0]
    new: NewRequest = plan.new_requests[0]
    assert plan.reset and new.token_list() == [1, 2, 3, 7, 8]
    assert (new.num_prompt_tokens, new.num_output_tokens) == (3, 2)
    assert events_of(out, Resumed) and not updates_of(out)
    out = s.handle(result_of(plan, token=9))
    assert [u.new_token_ids for u in updates_of(out)] == [[9]]
    assert s.requests["a"].output_token_ids == [7, 8, 9]


def test_a_duplicate_resubmission_is_ignored_silently_and_one_lacking_tokens_gets_them() -> None:
    """A resubmission of a request the scheduler holds: with the tokens it has, nothing to say;
    with fewer (its sender missed some: a replica set's new controller), the missing ones from where
    the sender's end (``catch_up``), the request itself unchanged."""
    s = scheduler()
    plans_of(s.handle(add("a", [1, 2, 3], outputs=[4])))
    assert ignored(s.handle(add("a", [1, 2, 3], outputs=[4], resume=True)))
    (update,) = updates_of(s.handle(add("a", [1, 2, 3], resume=True)))
    assert (update.new_token_ids, update.output_index, update.finish_reason) == ([4], 0, None)
    assert ignored(s.handle(add("a", [1, 2, 3], outputs=[9], resume=True)))  # not this copy's history
    assert s.requests["a"].output_token_ids == [4]
    # A plain AddRequest for an id in use is still an error.
    (update,) = updates_of(s.handle(add("a", [1, 2, 3])))
    assert update.finish_reason == "error" and "already in use" in (update.error or "")


@pytest.mark.parametrize(
    ("outputs", "params", "reason", "stop_reason"),
    [
        ([5, 6, 7], dict(max_tokens=3), "length", None),
        ([5, 0], dict(max_tokens=8), "stop", None),  # EOS
        ([5, 0], dict(max_tokens=8, min_tokens=2), "stop", None),
        ([5, 42], dict(max_tokens=8, stop_token_ids=[42]), "stop", 42),
        ([5] * 61, dict(max_tokens=None), "length", None),  # 3 + 61 == max_model_len
    ],
)
def test_a_resubmission_whose_outputs_already_end_it_finishes_at_once(
    outputs: list[int], params: dict[str, Any], reason: str, stop_reason: int | None
) -> None:
    s = scheduler()
    out = s.handle(add("a", [1, 2, 3], outputs=outputs, **params))
    (update,) = updates_of(out)
    assert (update.finish_reason, update.stop_reason, update.new_token_ids) == (reason, stop_reason, [])
    (finished,) = events_of(out, Finished)
    assert (finished.reason, finished.num_output_tokens) == (reason, len(outputs))
    assert "a" not in s.requests and not s.waiting


@pytest.mark.parametrize(
    ("outputs", "params"),
    [
        ([5, 0], dict(min_tokens=3)),  # EOS before min_tokens: it was masked, cannot end it
        ([5, 0], dict(ignore_eos=True)),
        ([5, 42], dict(stop_token_ids=[42], min_tokens=3)),
    ],
)
def test_a_resubmission_whose_stop_token_came_before_min_tokens_goes_on(outputs: list[int],
                                                                        params: dict[str, Any]) -> None:
    s = scheduler()
    out = s.handle(add("a", [1, 2, 3], outputs=outputs, **params))
    assert not updates_of(out) and events_of(out, Queued) and plans_of(out)


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (add("a", [1, 2], outputs=[-1]), "output token ids must lie in"),
        (add("a", [1, 2], outputs=[2**31]), "output token ids must lie in"),
        (add("a", [1] * 40, outputs=[1] * 30), "max_model_len (64)"),
        (add("a", [1, 2], outputs=[1] * 9), "more than max_tokens (8)"),
        (AddRequest(request_id="a", prompt_token_ids=[1], params=SamplingParams(), eos_token_ids=[0],
                    output_token_ids=[3]), "only taken with resume=True"),
        (add("a", [], outputs=[3]), "the prompt is empty"),
    ],
)
def test_bad_resubmissions_get_a_clear_error(message: AddRequest, error: str) -> None:
    s = scheduler()
    (update,) = updates_of(s.handle(message))
    assert update.finish_reason == "error" and error in (update.error or ""), update.error
    assert "a" not in s.requests


def test_a_new_scheduler_ignores_results_of_its_predecessors_plans() -> None:
    """Step ids start at 0 again: the old pipeline's result for its step 0 must not pass for the
    new reset plan's (only ``StepResult.reset`` tells them apart)."""
    s = scheduler()
    # The first message of a new scheduler may well be a result from the old pipeline: ignored,
    # and the (empty) reset plan goes out at once, to clear what the pipeline still holds.
    (reset,) = plans_of(s.handle(StepResult(step_id=0, req_ids=["a"], token_ids=[1])))
    assert reset.step_id == 0 and reset.reset and not reset.req_ids
    assert ignored(s.handle(StepResult(step_id=0, req_ids=["a"], token_ids=[1])))  # the predecessor's
    (plan,) = plans_of(s.handle(add("a", [1, 2, 3], resume=True)))
    assert plan.step_id == 1 and not plan.reset
    assert ignored(s.handle(StepResult(step_id=1, req_ids=["a"], token_ids=[1])))  # still the predecessor's
    assert ignored(s.handle(result_of(reset)))
    out = s.handle(result_of(plan, token=4))
    assert [u.new_token_ids for u in updates_of(out)] == [[4]]
    assert s.stats.num_stale_results == 3


def test_results_below_the_last_reset_stay_ignored_once_the_pipeline_runs_again() -> None:
    s = scheduler(max_steps_in_flight=1)
    (plan0,) = plans_of(s.handle(add("a", [1, 2, 3])))
    (plan1,) = plans_of(s.handle(result_of(plan0)))
    (plan2,) = plans_of(s.handle(RecoverPipeline(actor=WORKER, reason="exited")))
    (plan3,) = plans_of(s.handle(result_of(plan2)))
    assert ignored(s.handle(result_of(plan1)))  # a late straggler from the dead worker
    assert updates_of(s.handle(result_of(plan3)))


def test_a_second_reset_while_the_first_reset_plan_is_in_flight() -> None:
    s = scheduler()
    s.handle(add("a", [1, 2, 3]))
    first = plans_of(s.handle(RecoverPipeline(actor=WORKER, reason="exited")))[0]
    second = plans_of(s.handle(RecoverPipeline(actor=KV_CACHE_MANAGER, reason="hung")))[0]
    assert first.reset and second.reset and second.step_id > first.step_id
    assert ignored(s.handle(result_of(first)))  # a reset result, but of the older reset plan
    assert [u.new_token_ids for u in updates_of(s.handle(result_of(second)))] == [[5]]

