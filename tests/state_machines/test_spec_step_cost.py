"""What the speculation path costs where it finds nothing to draft: n-gram placeholders whose lookups
all find nothing still drain the worker's two steps in flight (it reads the step before back to look
up), so the policy prices such a step as a drafting one (0 drafted tokens) and stops planning them
(``spec_sim``'s device charges it the lost overlap). Unpriced, a fresh engine never learnt that
drafting costs anything and planned placeholders every step."""

from __future__ import annotations

from tests.state_machines.spec_sim import Device, simulate

OUTPUT = 400


def test_placeholders_whose_lookups_find_nothing_stop_being_planned() -> None:
    for batch in (1, 64):
        off = simulate(Device(found=0.0), batch, OUTPUT, speculate=False)
        on = simulate(Device(found=0.0), batch, OUTPUT)  # a fresh engine on text that never repeats
        assert on.drafting_steps == 0
        assert on.planned_steps <= 0.05 * on.steps, (batch, on.planned_steps, on.steps)  # probes only
        assert on.rate >= 0.98 * off.rate, (batch, on.rate / off.rate)


def test_a_pass_that_drafts_for_nobody_evaluates_no_request(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Per planning pass, the speculator's work over the batch: a request's params are checked for
    speculation once in its life, and a pass whose plan drafts nothing and probes nobody asks no
    request's acceptance (each request's idle step is all it counts)."""
    from vllm_actors.actors.scheduler import spec_policy, speculation

    calls = {"can_speculate": 0, "drafts_for": 0}

    def counted(name: str, original):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(speculation, "can_speculate", counted("can_speculate", speculation.can_speculate))
    monkeypatch.setattr(spec_policy.DraftPlan, "drafts_for", counted("drafts_for", spec_policy.DraftPlan.drafts_for))
    batch = 64
    on = simulate(Device(found=0.0), batch, OUTPUT)
    assert calls["can_speculate"] == batch  # not once per request and pass (2 x 64 x 400 before)
    # a request's acceptance is asked in the passes that plan drafts or probes only (and the
    # wall policy's own look at the plan's requests in those)
    assert calls["drafts_for"] <= 2 * batch * on.planned_steps, (calls, on.planned_steps)
