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
    """Per planning pass, the speculator's work over the batch: a pass whose plan drafts nothing and
    probes nobody asks no request's acceptance (each request's idle step is all it counts)."""
    from vllm_actors.actors.scheduler import spec_policy

    calls = {"drafts_for": 0}

    def counted(name: str, original):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return original(*args, **kwargs)
        return call

    monkeypatch.setattr(spec_policy.DraftPlan, "drafts_for", counted("drafts_for", spec_policy.DraftPlan.drafts_for))
    batch = 64
    on = simulate(Device(found=0.0), batch, OUTPUT)
    # a request's acceptance is asked in the passes that plan drafts or probes only (and the
    # wall policy's own look at the plan's requests in those)
    assert calls["drafts_for"] <= 2 * batch * on.planned_steps, (calls, on.planned_steps)


def test_a_lookup_ruled_out_before_its_pending_token_finds_nothing_with_any_token() -> None:
    """``NgramProposer.could_find`` with one token pending: where it says no, the lookup over the
    context and any next token (every token of the small vocabulary, and one never seen) is empty."""
    import random

    from vllm_actors.actors.worker.ngram_drafts import NgramProposer
    from vllm_actors.actors.worker.step_data import WorkerRequest
    from vllm_actors.protocol.ngram import propose_for
    from vllm_actors.protocol.sampling import SamplingParams

    rng = random.Random(0)
    ruled_out = 0
    for trial in range(600):
        min_n = rng.randint(1, 4)
        proposer = NgramProposer(min_n=min_n, max_n=min_n + rng.randint(0, 2))
        tokens = [rng.randint(0, 5) for _ in range(rng.randint(0, 14))]
        request = WorkerRequest(request_id=str(trial), token_ids=tokens, num_prompt_tokens=len(tokens),
                                num_output_tokens=0, params=SamplingParams(), eos_token_ids=[], num_pending=1)
        if not proposer.could_find(request):
            ruled_out += 1
            for token in range(7):
                assert propose_for(tokens + [token], 4, proposer.min_n, proposer.max_n) == [], (tokens, token)
        request.num_pending = 0
        assert proposer.could_find(request) == bool(propose_for(tokens, 4, proposer.min_n, proposer.max_n))
    assert ruled_out > 100  # the check rules out often enough to matter
