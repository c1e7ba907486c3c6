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
