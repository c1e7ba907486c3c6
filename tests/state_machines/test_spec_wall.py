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
