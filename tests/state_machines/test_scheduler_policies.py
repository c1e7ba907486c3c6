"""Scheduling policies driven at the scheduler's unit level: the order each policy
admits and runs requests in, and whom it preempts when KV blocks run short."""

from __future__ import annotations

import pytest

from vllm_actors.actors.scheduler.cost_model import FixedCostModel, OnlineCostModel
from vllm_actors.actors.scheduler.policies import AGING_STEPS
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import Finished, Preempted, Queued
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult
from vllm_actors.protocol.names import FRONTEND, KV_CACHE_MANAGER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams

# A deterministic step cost: 100 ms a step, nothing per token.
COST = FixedCostModel(a=0.1, b=0.0, c=0.0)


def make(policy: str, num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64,
         reject_unmeetable: bool = False) -> Scheduler:
    config = SchedulerConfig(max_model_len=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             enable_chunked_prefill=True, block_size=4, num_blocks=num_blocks,
                             max_steps_in_flight=1, enable_prefix_caching=False, scheduling_policy=policy,
                             reject_unmeetable=reject_unmeetable)
    return Scheduler(config, cost_model=COST)


def add(request_id: str, prompt_len: int = 4, max_tokens: int = 8, **kwargs: object) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=list(range(1, prompt_len + 1)),
                      params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=[0], **kwargs)


def plans(out: Outputs) -> list[StepPlan]:
    return [message for message in out.to(KV_CACHE_MANAGER) if isinstance(message, StepPlan)]


def events(out: Outputs) -> list[object]:
    return out.events


def finish_step(scheduler: Scheduler, plan: StepPlan) -> Outputs:
    """The plan's result: every request that completed its tokens samples token 7."""
    sampled = [rid for rid in plan.req_ids
               if rid in scheduler.requests and scheduler.requests[rid].num_pending]
    return scheduler.handle(StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=sampled,
                                       token_ids=[7] * len(sampled)))


def admission_order(policy: str, requests: list[AddRequest],
                    arriving: dict[int, AddRequest] | None = None) -> list[str]:
    """Requests queued behind a running one that fills the only sequence slot: the order the
    others are admitted in, one at a time. ``arriving``: more requests, each arriving once that
    many steps are done."""
    scheduler = make(policy, max_num_seqs=1)
    out = scheduler.handle(add("blocker", max_tokens=1))
    for request in requests:
        out += scheduler.handle(request)
    order: list[str] = []
    pending = plans(out)
    arriving = dict(arriving or {})
    while pending:
        plan = pending.pop(0)
        order.extend(rid for rid in [r.request_id for r in plan.new_requests]
                     if rid != "blocker" and rid not in order)  # first admissions (edf, lrs preempt for slots)
        out = finish_step(scheduler, plan)
        late = arriving.pop(scheduler.stats.num_steps, None)
        if late is not None:
            out += scheduler.handle(late)
        pending.extend(plans(out))
    return order


def test_fcfs_admits_in_arrival_order() -> None:
    requests = [add("a", max_tokens=1, priority=5), add("b", max_tokens=1, priority=0, e2e_deadline=1.0)]
    assert admission_order("fcfs", requests) == ["a", "b"]


def test_priority_admits_lowest_value_first_then_arrival() -> None:
    requests = [add("low", max_tokens=1, priority=5), add("high", max_tokens=1, priority=-1),
                add("mid1", max_tokens=1, priority=2), add("mid2", max_tokens=1, priority=2)]
    assert admission_order("priority", requests) == ["high", "mid1", "mid2", "low"]


def test_edf_admits_earliest_deadline_first_and_deadline_free_last() -> None:
    requests = [add("none"), add("late", e2e_deadline=50.0), add("ttft", ttft_deadline=10.0, e2e_deadline=90.0),
                add("early", e2e_deadline=20.0)]
    for request in requests:
        request.params.max_tokens = 1
    assert admission_order("edf", requests) == ["ttft", "early", "late", "none"]


def test_queued_event_carries_priority_and_deadlines() -> None:
    scheduler = make("edf")
    queued = [e for e in events(scheduler.handle(add("a", priority=3, ttft_deadline=1.5, e2e_deadline=9.0)))
              if isinstance(e, Queued)]
    assert [(q.priority, q.ttft_deadline, q.e2e_deadline) for q in queued] == [(3, 1.5, 9.0)]


def preempted_when_short(policy: str) -> list[str]:
    """Three requests decode in a pool that cannot hold all three: who is preempted first."""
    scheduler = make(policy, num_blocks=7, budget=64)
    out = scheduler.handle(add("early-low", prompt_len=8, max_tokens=40, priority=9))
    out += scheduler.handle(add("mid-high", prompt_len=8, max_tokens=40, priority=0))
    out += scheduler.handle(add("late-mid", prompt_len=8, max_tokens=40, priority=1))
    pending = plans(out)
    preempted: list[str] = []
    while pending and not preempted:
        out = finish_step(scheduler, pending.pop(0))
        preempted = [e.request_id for e in events(out) if isinstance(e, Preempted)]
        pending.extend(plans(out))
    return preempted


def test_priority_preempts_the_lowest_priority_running_request() -> None:
    assert preempted_when_short("priority") == ["early-low"]


def test_fcfs_preempts_the_latest_arrival() -> None:
    assert preempted_when_short("fcfs") == ["late-mid"]


def run_to_end(scheduler: Scheduler, out: Outputs, arriving: dict[int, AddRequest]) -> list[object]:
    """Step until every request finished (``arriving[k]`` comes once k steps are done): the events."""
    seen: list[object] = list(events(out))
    pending = plans(out)
    while pending:
        plan = pending.pop(0)
        out = finish_step(scheduler, plan)
        late = arriving.pop(scheduler.stats.num_steps, None)
        if late is not None:
            out += scheduler.handle(late)
        seen += events(out)
        pending.extend(plans(out))
    return seen


def slot_story(policy: str, urgent: AddRequest) -> tuple[list[str], list[str]]:
    """Every sequence slot (one) held by a long relaxed request; ``urgent`` arrives after 3 steps:
    who is preempted, and the order of first tokens."""
    scheduler = make(policy, max_num_seqs=1)
    out = scheduler.handle(add("relaxed", max_tokens=20, priority=5, e2e_deadline=100.0))
    seen = run_to_end(scheduler, out, {3: urgent})
    preempted = [e.request_id for e in seen if isinstance(e, Preempted)]
    finished = [e for e in seen if isinstance(e, Finished)]
    assert {e.request_id: e.num_output_tokens for e in finished} == {"relaxed": 20, urgent.request_id: 2}
    return preempted, [e.request_id for e in finished]


@pytest.mark.parametrize("policy", ["edf", "lrs"])
def test_deadline_policies_take_a_slot_from_a_less_urgent_running_request(policy: str) -> None:
    preempted, finished = slot_story(policy, add("urgent", max_tokens=2, priority=0, e2e_deadline=1.0))
    assert preempted == ["relaxed"]
    assert finished == ["urgent", "relaxed"]  # the relaxed one resumes and completes after


@pytest.mark.parametrize("policy", ["edf", "lrs"])
def test_a_less_urgent_arrival_waits_for_a_free_slot(policy: str) -> None:
    preempted, finished = slot_story(policy, add("later", max_tokens=2, priority=0, e2e_deadline=500.0))
    assert preempted == []
    assert finished == ["relaxed", "later"]


def test_lrs_weighs_a_ttft_deadline_against_the_prefill_only() -> None:
    """A stream with its end-to-end deadline 1.3 s away (17 tokens of 100 ms left at 3.0 s) keeps
    its slot against a long arrival whose first token is due in 10 s: that one's slack is 9.9 s
    (its prefill), not 0 (all its 100 tokens against its TTFT deadline)."""
    scheduler = make("lrs", max_num_seqs=1)
    out = scheduler.handle(add("stream", max_tokens=20, ttft_deadline=0.5, e2e_deadline=3.0))
    seen = run_to_end(scheduler, out, {3: add("long", max_tokens=100, ttft_deadline=10.0, e2e_deadline=120.0)})
    assert [e.request_id for e in seen if isinstance(e, Preempted)] == []
    assert [e.request_id for e in seen if isinstance(e, Finished)] == ["stream", "long"]


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_priority_and_fcfs_never_preempt_for_a_slot(policy: str) -> None:
    """vLLM's rule: a priority (or any fcfs) request preempts only when KV blocks run short."""
    preempted, finished = slot_story(policy, add("urgent", max_tokens=2, priority=0, e2e_deadline=1.0))
    assert preempted == []
    assert finished == ["relaxed", "urgent"]


def test_lrs_admits_least_slack_first_where_edf_admits_earliest_deadline() -> None:
    # "long": deadline 10 s, 100 tokens of 100 ms left: slack 0. "short": deadline 9 s, one token: 8.9 s.
    def requests() -> list[AddRequest]:
        return [add("none", max_tokens=1), add("short", max_tokens=1, e2e_deadline=9.0),
                add("long", max_tokens=100, e2e_deadline=10.0)]
    assert admission_order("lrs", requests()) == ["long", "short", "none"]
    assert admission_order("edf", requests()) == ["short", "long", "none"]


def test_edf_gives_the_budget_to_an_urgent_prefill_before_a_relaxed_decode() -> None:
    """The step's token budget is shared in the policy's order: a running request with an early
    deadline takes its prefill chunk before a slack-rich request decodes."""
    scheduler = make("edf", budget=16)
    out = scheduler.handle(add("relaxed", prompt_len=4, max_tokens=50, e2e_deadline=100.0))
    plan = plans(out)[0]
    out = scheduler.handle(add("urgent", prompt_len=40, max_tokens=2, e2e_deadline=1.0))
    out += finish_step(scheduler, plan)
    plan = plans(out)[0]  # "urgent" admitted: a 15-token chunk
    plan = plans(finish_step(scheduler, plan))[0]
    assert plan.req_ids[0] == "urgent" and plan.num_tokens[0] == 16  # its chunk first, the whole budget


def test_priority_ages_a_low_priority_request_in_under_a_bounded_rate_of_high_priority_ones() -> None:
    """Starvation freedom: one high-priority request arrives every step (the only slot serves one
    a step); the low-priority one still gets in, after about AGING_STEPS steps."""
    steps = 3 * AGING_STEPS
    arriving = {step: add(f"high{step}", max_tokens=1, priority=0) for step in range(1, steps)}
    order = admission_order("priority", [add("low", max_tokens=1, priority=1), add("high0", max_tokens=1)],
                            arriving)
    assert "low" in order
    assert order.index("low") <= 2 * AGING_STEPS + 1


def test_admission_rejects_an_unmeetable_deadline_and_keeps_serving() -> None:
    scheduler = make("edf", reject_unmeetable=True)
    # 20 tokens at 100 ms a step: about 2 s; a 1 s target cannot be met, a 3 s one can.
    out = scheduler.handle(add("late", max_tokens=20, arrival_time=100.0, e2e_deadline=101.0))
    updates = [u for m in out.to(FRONTEND) for u in m.updates]
    assert [(u.request_id, u.finish_reason) for u in updates] == [("late", "error")]
    assert updates[0].error is not None and updates[0].error.startswith("unmeetable deadline")
    assert "late" not in scheduler.requests
    out = scheduler.handle(add("ok", max_tokens=20, arrival_time=100.0, e2e_deadline=103.0))
    assert "ok" in scheduler.requests and not out.to(FRONTEND)
    # The queue ahead counts: behind a long prefill the TTFT target of 150 ms is missed.
    scheduler = make("fcfs", reject_unmeetable=True, budget=16)
    scheduler.handle(add("long", prompt_len=64, max_tokens=1))
    out = scheduler.handle(add("next", max_tokens=1, arrival_time=5.0, ttft_deadline=5.15))
    assert [u.finish_reason for m in out.to(FRONTEND) for u in m.updates] == ["error"]


def test_without_admission_control_an_unmeetable_request_is_served() -> None:
    scheduler = make("edf")
    out = scheduler.handle(add("late", max_tokens=20, arrival_time=100.0, e2e_deadline=101.0))
    assert plans(out)[0].req_ids == ["late"]


def test_online_cost_model_fits_the_step_times() -> None:
    model = OnlineCostModel()
    for prefill, decodes in [(0, 1), (100, 0), (50, 8), (0, 32), (400, 4), (10, 10)] * 5:
        model.observe(prefill, decodes, 0.005 + 0.0002 * prefill + 0.001 * decodes)
    assert abs(model.step_seconds(200, 16) - (0.005 + 0.04 + 0.016)) < 1e-4


@pytest.mark.parametrize("policy", ["fcfs", "edf"])
def test_admission_counts_only_the_queue_the_policy_puts_ahead(policy: str) -> None:
    """Behind a waiting 64-token prompt (4 steps of 16) an urgent request misses a 250 ms TTFT
    target under fcfs; under edf it jumps the deadline-free one and is admitted."""
    scheduler = make(policy, reject_unmeetable=True, budget=16, max_num_seqs=1)
    scheduler.handle(add("blocker", prompt_len=4, max_tokens=50))
    scheduler.handle(add("batch", prompt_len=64, max_tokens=1))
    out = scheduler.handle(add("urgent", max_tokens=1, arrival_time=5.0, ttft_deadline=5.25))
    refused = [u.request_id for m in out.to(FRONTEND) for u in m.updates]
    assert refused == (["urgent"] if policy == "fcfs" else [])
