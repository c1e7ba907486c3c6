"""The drafts-per-step policy of n-gram drafts in the worker (two steps in flight), priced in wall time
per batch size (``spec_wall``), driven through the speculator against a fake device whose step costs
are those measured on the H100 with SmolLM2-135M (``spec_sim``): a plain decode step 0.71 ms at batch
1, a verifying step read back at once 0.55 ms more, the plain step after it a quarter of a
millisecond more. At batch 1 it drafts from the first request on; where verification costs more than
it gains at 64 requests it drafts (almost) nothing; where it gains it drafts for the whole batch, its
tail too (a request left out would finish last), without flapping; one outlier (a first use that
compiles) does not stop it."""

from __future__ import annotations

import pytest

from tests.state_machines.spec_sim import MS, Device, new_speculator, simulate
from vllm_actors.actors.scheduler.cost_model import FixedCostModel, StepFeatures
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.actors.scheduler.spec_policy import expected_tokens
from vllm_actors.actors.scheduler.spec_probes import Pace
from vllm_actors.actors.scheduler.spec_wall import WallPolicy
from vllm_actors.protocol.sampling import SamplingParams

OUTPUT = 192


def test_batch_one_drafts_from_the_first_request_on() -> None:
    off = simulate(Device(), 1, OUTPUT, speculate=False).requests[0]
    run = simulate(Device(), 1, OUTPUT, waves=3)
    assert all(off / seconds >= 1.5 for seconds in run.requests), run.requests


def test_one_outlier_verification_does_not_stop_drafting() -> None:
    off = simulate(Device(), 1, OUTPUT, speculate=False).requests[0]
    run = simulate(Device(first_verify=0.1), 1, OUTPUT, waves=3)  # 100 ms: a compile at first use
    assert all(off / seconds >= 1.5 for seconds in run.requests[1:]), run.requests


def costly() -> Device:
    """Verification whose fixed part grows with the batch (the drained pipeline, the padded path):
    at 64 requests drafting loses even with every request drafting."""
    return Device(verify_fixed=lambda b: 0.55 * MS + 0.07 * MS * b)


def test_no_drafts_where_verification_costs_more_than_it_gains() -> None:
    for device in (costly, Device):  # warm from batch 1, as a server is (and the benchmark)
        spec = new_speculator()
        simulate(device(), 1, OUTPUT, speculator=spec)
        off = simulate(device(), 64, OUTPUT, speculate=False)
        on = simulate(device(), 64, OUTPUT, speculator=spec)
        if device is costly:
            assert on.rate >= 0.98 * off.rate and on.drafting_steps <= 4, (on.rate / off.rate, on.drafting_steps)
        else:  # where it pays, the whole batch drafts
            assert on.rate >= 1.3 * off.rate, on.rate / off.rate


def test_a_batch_drafts_to_its_last_request_without_flapping() -> None:
    device = Device()
    switches = []
    original = device.step

    def step(batch: int, drafts: dict[str, int], after_drafting: bool) -> float:
        switches.append(bool(drafts) != after_drafting)
        return original(batch, drafts, after_drafting)

    spec = new_speculator()
    for batch in (1, 8):  # the benchmark's order
        simulate(Device(), batch, OUTPUT, speculator=spec)
    device.step = step  # type: ignore[method-assign]  # counts the switches between drafting and plain steps
    run = simulate(device, 16, OUTPUT, speculator=spec)
    off = simulate(Device(), 16, OUTPUT, speculate=False)
    assert sum(switches) <= 6 and run.drafting_steps >= 0.8 * run.steps, (sum(switches), run.drafting_steps, run.steps)
    assert run.rate >= 1.4 * off.rate, run.rate / off.rate


class Untouchable:
    """A running request a pass must not read."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"a quiet pass read a request's {name}")


def test_a_quiet_plan_holds_without_reading_the_requests() -> None:
    """Where nothing is drafted and no probe is due, a pass costs O(1): the plan holds while the batch
    and the acceptances are unchanged (each request's idle steps still counted), and is chosen again
    after REVIEW_PASSES or once the batch changes."""
    from vllm_actors.actors.scheduler.request import ScheduledRequest, Status
    from vllm_actors.actors.scheduler.speculation import REVIEW_PASSES
    from vllm_actors.protocol.sampling import SamplingParams

    spec = new_speculator()
    simulate(costly(), 1, OUTPUT, speculator=spec)
    simulate(costly(), 64, OUTPUT, speculator=spec)  # drafting does not pay at 64
    speculator = spec[0]
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    running = [ScheduledRequest(f"r{i}", list(range(100)), params, [], output_token_ids=[1], num_computed_tokens=101,
                                status=Status.RUNNING, in_worker=True) for i in range(64)]
    speculator.begin_pass(running)  # a full look (their paces made): nothing to draft, no probe due
    assert speculator.quiet and not speculator.drafts(running[0], 1 << 20, 1 << 20)
    stand_ins = [Untouchable()] * 64
    for _ in range(REVIEW_PASSES - 1):
        speculator.begin_pass(stand_ins)  # type: ignore[arg-type]  # never read
        assert not speculator.drafts(stand_ins[0], 1 << 20, 1 << 20)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="a quiet pass read"):
        speculator.begin_pass(stand_ins)  # type: ignore[arg-type]  # the review is due: it reads them
    speculator.begin_pass(running)
    assert speculator._paces["r0"].idle == REVIEW_PASSES  # every quiet pass an idle step of each
    with pytest.raises(AssertionError, match="a quiet pass read"):
        speculator.begin_pass(stand_ins[:63])  # type: ignore[arg-type]  # the batch changed


# Session 21 on an H200 (SmolLM2-135M, n-gram, a closed batch of 64): plain steps of ~10 requests overlap
# at ~0.77 ms (two in flight); a drafting step of that size takes ~1.65 ms (read back at once) for ~1.8
# tokens a request; plain steps of 64 take 1.46 ms.
def h200(longest: int = 1 << 20, acceptance: float = 0.8) -> Device:
    return Device(plain=lambda b: 0.65 * MS + 0.0126 * MS * b, verify_fixed=lambda b: 0.85 * MS,
                  per_token=0.0025 * MS, switch=lambda b: 0.3 * MS, acceptance=acceptance, longest=longest)


def test_the_tail_of_a_closed_batch_drafts_nothing_where_drafting_loses() -> None:
    """Ten requests whose lookups find one draft of the 4 planned, right 4 times in 5: a drafting step
    gains 1.8 tokens a request in 1.65 ms where plain steps make 1 in 0.77 ms. Counted as all right when
    the one found was, their acceptance read 0.8 a draft as if all 4 were found (3.4 tokens a step) and
    they drafted on at x0.80 of plain decoding; a wave after the first (the acceptance of the text
    measured, as in the tail of a batch that has drafted all along) runs as plain decoding does."""
    spec = new_speculator()
    simulate(h200(), 1, OUTPUT, speculator=spec)  # warm at batch 1, as the benchmark
    off = simulate(h200(), 10, OUTPUT, speculate=False)
    on = simulate(h200(longest=1), 10, OUTPUT, waves=2, speculator=spec)
    assert off.requests[0] / on.requests[1] >= 0.98, (off.requests[0] / on.requests[1], on.drafting_steps, on.steps)


def tail_pace(tokens: float) -> Pace:
    """A request whose drafting steps gained ``tokens`` each (4 planned: one right in ``tokens - 1``)."""
    pace = Pace()
    for step in range(60):
        pace.verified(4, 1 if (step % 5) < round((tokens - 1) * 5) else 0)
    return pace


def test_a_bucket_drafts_only_against_its_own_plain_steps_measured_between_plain_steps() -> None:
    """The shrinking batch's new bucket (10 requests) had no plain step of its own: the step cost model
    priced it (fitted on execution times, here 1.3 ms), and drafting at 1.65 ms for 1.8 tokens a request
    looked like a gain. Now it runs plain until it has measured its own (0.77 ms), and a plain step read
    back only once a drafting plan came (2.2 ms: it waited for it) does not count as one."""
    policy = WallPolicy(FixedCostModel(a=1.17 * MS, b=0.0, c=0.013 * MS))  # 1.3 ms at 10 requests
    for _ in range(4):
        policy.account(StepFeatures(0, 64), False, [], 1.46 * MS)
    for _ in range(30):  # the 64 requests drafting, 2.8 ms a step
        policy.choose([], 64, 4, 0.0)
        policy.account(StepFeatures(0, 64), True, [4] * 64, 2.8 * MS)
    candidates = [(ScheduledRequest(f"r{i}", [1, 2], SamplingParams(), [], output_token_ids=[3]), tail_pace(1.8))
                  for i in range(10)]
    assert expected_tokens(4, candidates[0][1].acceptance.alpha) == pytest.approx(1.8, abs=0.1)
    for _ in range(3):  # the batch shrank into the bucket with drafting plans in flight
        policy.account(StepFeatures(0, 10), True, [1] * 10, 1.65 * MS)
    plan, probers = policy.choose(candidates, 10, 4, 0.0)
    assert not plan.num_drafts and not probers  # its plain steps first
    policy.account(StepFeatures(0, 10), False, [], 0.77 * MS + 1.0 * MS)  # the first after drafting: the switch
    for _ in range(3):
        policy.choose(candidates, 10, 4, 0.0)
        policy.account(StepFeatures(0, 10), False, [], 0.77 * MS)
    assert policy.costs.bucket(10).plain == pytest.approx(0.77 * MS)
    for _ in range(20):  # were it to draft (probes, a plan): its drafting steps as measured
        plan, probers = policy.choose(candidates, 10, 4, 0.0)
        assert not plan.num_drafts, plan
        if probers:
            policy.account(StepFeatures(0, 10), False, [], 2.2 * MS)  # the plain step before: read back late
            policy.account(StepFeatures(0, 10), True, [1] * len(probers), 1.65 * MS)
        else:
            policy.account(StepFeatures(0, 10), False, [], 0.77 * MS)
    assert policy.costs.bucket(10).plain == pytest.approx(0.77 * MS, rel=0.02)


def test_batch_one_drafts_on_at_twice_a_plain_steps_cost() -> None:
    """At batch 1 on the H200 a drafting step costs more than twice a plain one (1.51 ms against 0.66
    ms), and a request whose drafts gain 3.8 tokens a step (3.4 by its acceptance) drafts in every
    step: 2.2 tokens a millisecond against 1.5."""
    policy = WallPolicy(FixedCostModel(a=0.66 * MS, b=0.0, c=0.0))
    for _ in range(4):
        policy.choose([], 1, 4, 0.0)
        policy.account(StepFeatures(0, 1), False, [], 0.66 * MS)
    pace = Pace()
    request = ScheduledRequest("r", [1, 2], SamplingParams(), [], output_token_ids=[3])
    for step in range(200):
        plan, _ = policy.choose([(request, pace)], 1, 4, 0.0)
        assert plan.drafts_for(pace.acceptance) >= 3, (step, plan, pace.acceptance.alpha)
        policy.account(StepFeatures(0, 1), True, [4], 1.51 * MS)
        pace.verified(4, (4, 4, 2, 1, 3)[step % 5])
    assert expected_tokens(4, pace.acceptance.alpha) == pytest.approx(3.4, abs=0.15)
    assert policy.costs.bucket(1).draft.seconds(0, 4) == pytest.approx(0.85 * MS, rel=0.02)


def test_a_plain_step_read_back_once_a_drafting_plan_came_does_not_price_plain_decoding() -> None:
    """With two steps in flight the plain step before a drafting one is read back only once the drafting
    plan has come (and the pipeline drains for it): its interval (2.2 ms in the tail on the H200) is a
    cost of drafting, not the 0.66 ms plain decoding runs at."""
    policy = WallPolicy(FixedCostModel(a=0.66 * MS, b=0.0, c=0.0))
    for _ in range(4):
        policy.choose([], 1, 4, 0.0)
        policy.account(StepFeatures(0, 1), False, [], 0.66 * MS)
    pace = Pace()
    for _ in range(20):
        pace.verified(4, 4)
    plan, _ = policy.choose([(ScheduledRequest("r", [1, 2], SamplingParams(), [], output_token_ids=[3]), pace)],
                            1, 4, 0.0)
    assert plan.drafts_for(pace.acceptance) == 4
    policy.account(StepFeatures(0, 1), False, [], 2.2 * MS)  # the plain step planned before it
    assert policy.costs.bucket(1).plain == pytest.approx(0.66 * MS)
    policy.account(StepFeatures(0, 1), True, [4], 1.51 * MS)
    policy.account(StepFeatures(0, 1), False, [], 0.96 * MS)  # the first after a drafting run: its switch
    assert policy.costs.bucket(1).plain == pytest.approx(0.66 * MS) and policy.costs.bucket(1).switch > 0
