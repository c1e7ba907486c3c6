"""Speculative decoding's pure parts: the config's checks, the n-gram proposer, the drafts-per-step
policy (never slower by the cost model: backs off to 0 as the batch grows, no cliff)."""

from __future__ import annotations

import random

import pytest

from vllm_actors.actors.scheduler.cost_model import FixedCostModel
from vllm_actors.actors.scheduler.spec_policy import (
    BUCKETS,
    NO_DRAFTS,
    Acceptance,
    DraftCost,
    choose_drafts,
    expected_tokens,
)
from vllm_actors.engine_args import make_engine_config
from vllm_actors.protocol.ngram import propose_for
from vllm_actors.protocol.speculative import parse_speculative_config


@pytest.mark.parametrize(("given", "message"), [
    ({"method": "medusa", "num_speculative_tokens": 2}, "must be one of"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "from 1 to 32"),
    ({"method": "ngram", "num_speculative_tokens": True}, "from 1 to 32"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must not exceed"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown keys"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "eagle3"}, "needs 'model'"),
    ({"model": "draft", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "must be 1"),
    ("not a dict", "must be a dict"),
])
def test_bad_speculative_configs_are_refused_with_what_is_allowed(given: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(given)  # type: ignore[arg-type]  # the bad types are the point


def test_engine_config_takes_vllms_dict_and_the_cli_json(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = make_engine_config("m", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                             "prompt_lookup_max": 4}})
    spec = config.speculative_config
    assert spec is not None
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (3, 4, 4)
    assert make_engine_config("m", {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'}
                              ).speculative_config == parse_speculative_config(
                                  {"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="does not exist"):
        make_engine_config("m", {"speculative_config": {"method": "draft_model", "model": str(tmp_path / "no"),
                                                        "num_speculative_tokens": 2}})
    eagle = make_engine_config("m", {"speculative_config": {"method": "eagle3", "model": str(tmp_path)}})
    assert eagle.speculative_config is not None and eagle.speculative_config.num_speculative_tokens == 1
    with pytest.raises(ValueError, match="'eagle3' runs with tensor_parallel_size 1 only"):
        make_engine_config("m", {"tensor_parallel_size": 2,
                                 "speculative_config": {"method": "eagle3", "model": str(tmp_path)}})
    draft = make_engine_config("m", {"speculative_config": {"model": str(tmp_path), "num_speculative_tokens": 2}})
    assert draft.speculative_config is not None and draft.speculative_config.method == "draft_model"  # vLLM's spelling
    with pytest.raises(ValueError, match="JSON object"):
        make_engine_config("m", {"speculative_config": "{method: ngram}"})


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    assert propose_for([1, 2, 3, 4, 5, 1, 2, 3], 3, 2, 3) == [4, 5, 1]
    assert propose_for([9, 2, 3, 7, 1, 2, 3, 8, 2, 3], 2, 2, 2) == [8, 2]  # the latest occurrence
    assert propose_for([1, 2, 3, 9, 9], 3, 2, 3) == []  # no earlier match of at least min_n
    assert propose_for([256, 1, 2, 256, 1], 2, 1, 2) == [2, 256]  # byte-level hits off token bounds ignored
    assert propose_for([1, 2, 1, 2], 0, 1, 2) == []
    # the latest match's continuation runs into the end (the text just copied): an earlier one followed by
    # every draft asked for is taken instead; where none is, the latest, cut short
    assert propose_for([2, 3, 4, 5, 6, 7, 9, 2, 3, 4, 2, 3], 4, 2, 2) == [4, 5, 6, 7]
    assert propose_for([9, 2, 3, 4, 2, 3], 4, 2, 2) == [4, 2, 3]


def _lookup(tokens: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup over the token list, position by position (the reference): the latest earlier match
    of the longest matching suffix, the latest followed by ``num_drafts`` tokens where there is one."""
    if num_drafts < 1:
        return []
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        starts = [start for start in range(len(tokens) - n - 1, -1, -1) if tokens[start:start + n] == tokens[-n:]]
        full = [start for start in starts if start + n + num_drafts <= len(tokens)]
        if starts:  # the latest followed by every draft asked for, else the latest
            start = (full or starts)[0]
            return tokens[start + n:start + n + num_drafts]
    return []


def test_ngram_lookup_equals_the_position_by_position_search() -> None:
    """The byte search (its shortest suffix looked up first, the longest match then) proposes what a
    search over the positions does: small vocabularies repeat n-grams; ids past 255 make hits off
    token bounds."""
    rng = random.Random(7)
    for _ in range(3000):
        vocab = rng.choice([2, 3, 5, 300, 70000])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        num_drafts = rng.randint(0, 5)
        assert propose_for(tokens, num_drafts, min_n, max_n) == _lookup(tokens, num_drafts, min_n, max_n), \
            (tokens, num_drafts, min_n, max_n)


def _priced(fixed: float = 0.0, per_pass: float = 0.0, per_token: float = 0.0) -> DraftCost:
    cost = DraftCost()
    cost.model.theta[:] = (fixed, per_token, per_pass, 0.0, 0.0)  # nothing per token caught up on
    return cost


def test_drafts_per_step_back_off_to_zero_as_the_batch_grows() -> None:
    """A launch-bound step (fixed cost a) makes drafts nearly free at batch 1; per-token cost t
    grows with the batch until drafting loses, and the number falls step by step to 0."""
    plain = FixedCostModel(a=0.010, b=0.0002, c=0.0001)
    extra = _priced(per_token=0.0002)
    bucket = round(0.7 * BUCKETS)
    by_batch = [choose_drafts([bucket] * batch, batch, 5, plain, extra).num_drafts for batch in (1, 4, 16, 64, 256)]
    assert by_batch[0] == 5 and by_batch[-1] == 0
    assert by_batch == sorted(by_batch, reverse=True)  # never more drafts at a larger batch
    assert choose_drafts([0], 1, 5, plain, extra) == NO_DRAFTS  # nothing accepted: nothing drafted
    for batch in range(1, 300, 7):  # whatever it picks promises at least not speculating's rate
        k = choose_drafts([BUCKETS // 2] * batch, batch, 5, plain, extra).num_drafts
        rate = batch * expected_tokens(k, 0.5) / (plain.step_seconds(0, batch) + extra.seconds(k, k * batch))
        assert rate >= batch / plain.step_seconds(0, batch)


def test_a_costly_drafting_step_stops_drafting_at_moderate_acceptance() -> None:
    """The measured extra cost of a drafting step (a draft model's passes, verification's path)
    outweighs what an acceptance of 0.6 gains; a cheap one does not."""
    plain = FixedCostModel(a=0.010, b=0.0, c=0.0001)
    bucket = round(0.6 * BUCKETS)
    assert choose_drafts([bucket], 1, 4, plain, _priced(fixed=0.001, per_pass=0.0005)).num_drafts >= 2
    assert choose_drafts([bucket], 1, 4, plain, _priced(fixed=0.010, per_pass=0.003)) == NO_DRAFTS
    learnt = DraftCost()
    for _ in range(20):  # what drafting steps measured beyond plain ones: 10 ms and 3 ms a draft
        learnt.observe(4, 4, 1, 0.022)
        learnt.observe(2, 2, 1, 0.016)
    assert learnt.seconds(4, 4, 1) == pytest.approx(0.022, rel=0.05)
    assert choose_drafts([bucket], 1, 4, plain, learnt) == NO_DRAFTS


def test_mixed_batches_draft_for_the_requests_that_gain() -> None:
    """One step in flight: requests of high acceptance draft, those of low acceptance do not (the
    plan's threshold lies between them). Two steps in flight: those not drafting run a plain step
    in between, which costs more here than the low ones' cheap drafts, so all draft; one request of
    moderate acceptance among low ones pays for neither."""
    plain = FixedCostModel(a=0.010, b=0.0, c=0.0001)
    extra = _priced(fixed=0.0005, per_token=0.0001)
    high, low = round(0.95 * BUCKETS), round(0.05 * BUCKETS)
    plan = choose_drafts([high] * 4 + [low] * 4, 8, 4, plain, extra, overlapped=False)
    assert plan.num_drafts == 4 and low < plan.min_bucket <= high
    assert plan.drafts_for(Acceptance(accepted=0.95, trials=1.0)) == 4
    assert plan.drafts_for(Acceptance(accepted=0.05, trials=1.0)) == 0
    assert choose_drafts([high] * 4 + [low] * 4, 8, 4, plain, extra).min_bucket == low
    moderate = round(0.5 * BUCKETS)
    for overlapped in (False, True):
        assert choose_drafts([moderate] + [low] * 7, 8, 4, plain, extra, overlapped) == NO_DRAFTS


def test_acceptance_counts_the_drafts_tested() -> None:
    """Each right draft a success and the first wrong one a failure (those after it untested): an
    acceptance of 0.5 per draft reads 0.5, not accepted over drafted tokens."""
    acceptance = Acceptance()
    assert acceptance.alpha == 0.5
    for _ in range(100):  # per step: 2 of 4 right, then 0 of 4, then 1 of 4
        acceptance.observe(4, 2)
        acceptance.observe(4, 0)
        acceptance.observe(4, 1)
    assert acceptance.alpha == pytest.approx(0.5, abs=0.02)
    for _ in range(100):
        acceptance.observe(4, 0)
    assert acceptance.alpha < 0.06
    assert expected_tokens(3, 1.0) == 4 and expected_tokens(3, 0.0) == 1


def test_acceptance_folds_in_how_many_drafts_the_lookups_find() -> None:
    """Lookups that find one draft of the 4 planned, right 7 times in 8, gain 1.875 tokens a step:
    the bucket the plan prices them by gains that at 4 drafts (0.875 of drafts right alone said 3.9).
    A plan of fewer drafts that finds them all says nothing of how far the lookups reach."""
    short, full = Acceptance(), Acceptance()
    for step in range(100):
        right = step % 8 != 0
        short.observe(1, int(right), 4)
        full.observe(4, 4 if right else 0, 4)
    assert short.alpha == pytest.approx(0.84, abs=0.02)  # the prior: 0.5
    assert short.reach == pytest.approx(1.14, abs=0.02)  # the prior: every draft found
    gains = expected_tokens(short.reach, short.alpha)  # 1.94
    assert expected_tokens(4, short.bucket / BUCKETS) == pytest.approx(gains, abs=0.05)
    assert expected_tokens(4, short.alpha) > 3.2  # what it read as without its reach
    assert full.reach == pytest.approx(4) and full.bucket == round(full.alpha * BUCKETS)
    probed = Acceptance()
    for _ in range(20):
        probed.observe(1, 1, 4)  # the depth planned once
        probed.observe(1, 1, 1)  # probes: one planned, one found
    assert probed.looks == pytest.approx(sum(0.95 ** i for i in range(20)))  # the probes not counted


def test_serve_takes_speculative_config_as_json() -> None:
    from vllm_actors.cli import build_parser, engine_kwargs

    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    kwargs = engine_kwargs(build_parser().parse_args(["serve", "--speculative-config", text]))
    assert kwargs["speculative_config"] == text
    spec = make_engine_config("m", kwargs).speculative_config
    assert spec is not None and (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min) == ("ngram", 3, 1)
    assert engine_kwargs(build_parser().parse_args(["serve"]))["speculative_config"] is None


def test_probes_wait_for_their_share_of_the_time_and_share_a_step() -> None:
    """A request idle for the interval probes, with those past half of it, once the probe step's
    predicted extra cost is within PROBE_SHARE of the seconds since the last drafting step; a
    request whose drafts were all right probes again at once."""
    from vllm_actors.actors.scheduler.request import ScheduledRequest
    from vllm_actors.actors.scheduler.spec_probes import PROBE_INTERVAL, PROBE_SHARE, Pace, choose_probers
    from vllm_actors.protocol.sampling import SamplingParams

    def request(name: str) -> ScheduledRequest:
        return ScheduledRequest(request_id=name, prompt_token_ids=[1, 2], output_token_ids=[3],
                                params=SamplingParams(), eos_token_ids=[])

    cost = _priced(fixed=0.010)
    due, half, fresh = Pace(idle=PROBE_INTERVAL), Pace(idle=PROBE_INTERVAL // 2), Pace(idle=3)
    candidates = [(request("due"), due), (request("half"), half), (request("fresh"), fresh)]
    assert choose_probers(candidates, cost, 0.5 * 0.010 / PROBE_SHARE) == set()
    assert choose_probers(candidates, cost, 0.010 / PROBE_SHARE) == {"due", "half"}
    streak = Pace()
    streak.drafting(3)
    streak.verified(1, 1)  # its probe was right
    assert choose_probers([(request("streak"), streak)], cost, 0.0) == {"streak"}
    streak.verified(1, 0)
    assert streak.streak == 0 and choose_probers([(request("streak"), streak)], cost, 0.0) == set()


def test_worker_ngram_drafts_verify_only_what_the_lookup_finds() -> None:
    from vllm_actors.actors.worker.draft_slots import short_drafts
    from vllm_actors.actors.worker.ngram_drafts import NgramProposer
    from vllm_actors.actors.worker.step_data import WorkerRequest
    from vllm_actors.protocol.messages import StepPlan
    from vllm_actors.protocol.sampling import SamplingParams
    from vllm_actors.protocol.speculative import WORKER_DRAFT

    def request(request_id: str, tokens: list[int]) -> WorkerRequest:
        return WorkerRequest(request_id=request_id, token_ids=tokens, num_prompt_tokens=len(tokens),
                             num_output_tokens=0, params=SamplingParams(), eos_token_ids=[])

    requests = {"copy": request("copy", [1, 2, 3, 4, 9, 1, 2]), "new": request("new", [5, 6, 7]),
                "given": request("given", [1, 1])}
    plan = StepPlan(step_id=0, req_ids=["copy", "new", "given"], num_tokens=[4, 3, 2], num_blocks=[1, 1, 1],
                    new_block_ids=[[], [], []],
                    draft_token_ids={"copy": [WORKER_DRAFT] * 3, "new": [WORKER_DRAFT] * 2, "given": [8]})
    proposer = NgramProposer(min_n=1, max_n=2)
    filled = proposer.propose(plan, requests)
    # "new" finds nothing: no filler, a plain decode row (its placeholders' tokens dropped)
    assert filled.draft_token_ids == {"copy": [3, 4, 9], "given": [8]}
    assert filled.num_tokens == [4, 1, 2] and short_drafts(plan, filled) == {"new": 0}
    requests["copy"].token_ids += [3, 4]  # the tokens grow between proposals (packed incrementally)
    assert proposer.propose(plan, requests).draft_token_ids["copy"] == [9, 1, 2]
    requests["copy"].token_ids += [7]  # "7" occurs nowhere before: nothing found
    requests["new"].token_ids += [7]  # "7" found right before the end: one draft of two placeholders
    filled = proposer.propose(plan, requests)
    assert filled.draft_token_ids == {"new": [7], "given": [8]} and filled.num_tokens == [1, 2, 2]
    assert short_drafts(plan, filled) == {"copy": 0, "new": 1}


def test_worker_ngram_lookups_found_hopeless_before_the_read_back_are_not_repeated(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from vllm_actors.actors.worker import ngram_drafts
    from vllm_actors.actors.worker.step_data import WorkerRequest
    from vllm_actors.protocol.messages import StepPlan
    from vllm_actors.protocol.sampling import SamplingParams
    from vllm_actors.protocol.speculative import WORKER_DRAFT

    def requests() -> dict[str, WorkerRequest]:  # each with its step in flight's token pending
        return {request_id: WorkerRequest(request_id=request_id, token_ids=tokens, num_prompt_tokens=len(tokens),
                                          num_output_tokens=0, params=SamplingParams(), eos_token_ids=[], num_pending=1)
                for request_id, tokens in (("dead", [1, 2, 3, 4]), ("live", [5, 6, 5]))}

    plan = StepPlan(step_id=7, req_ids=["dead", "live"], num_tokens=[3, 3], num_blocks=[1, 1], new_block_ids=[[], []],
                    draft_token_ids={"dead": [WORKER_DRAFT] * 2, "live": [WORKER_DRAFT] * 2})
    lookups: list[int] = []
    lookup = ngram_drafts.propose_ngram
    monkeypatch.setattr(ngram_drafts, "propose_ngram",
                        lambda packed, *args: lookups.append(len(packed)) or lookup(packed, *args))
    filled: dict[bool, StepPlan] = {}
    for checked in (True, False):
        proposer, current = ngram_drafts.NgramProposer(min_n=2, max_n=3), requests()
        # "dead": its last token 4 occurs nowhere before, whatever follows; "live": 5 does
        assert not checked or proposer.without_hopeless(plan, current) is None
        for request, token in zip(current.values(), (3, 6), strict=True):  # the step in flight read back
            request.token_ids.append(token)
            request.num_pending = 0
        lookups.clear()
        filled[checked] = proposer.propose(plan, current)
        assert len(lookups) == (1 if checked else 2)  # "dead" is not looked up again after the check
    assert filled[True] == filled[False] and filled[True].draft_token_ids == {"live": [5, 6]}
