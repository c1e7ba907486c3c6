"""Speculative decoding's pure parts: the config's checks, the n-gram proposer, the drafts-per-step
policy (never slower by the cost model: backs off to 0 as the batch grows, no cliff)."""

from __future__ import annotations

import pytest

from vllm_actors.actors.scheduler.cost_model import FixedCostModel
from vllm_actors.actors.scheduler.ngram import propose_for
from vllm_actors.actors.scheduler.spec_policy import Acceptance, choose_num_drafts, expected_tokens
from vllm_actors.engine_args import make_engine_config
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


def test_drafts_per_step_back_off_to_zero_as_the_batch_grows() -> None:
    """A launch-bound step (fixed cost a) makes drafts nearly free at batch 1; per-token cost b
    grows with the batch until drafting loses, and the number falls step by step to 0."""
    cost = FixedCostModel(a=0.010, b=0.0002, c=0.0001)
    by_batch = [choose_num_drafts(5, 0.7, batch, 0, cost) for batch in (1, 4, 16, 64, 256)]
    assert by_batch[0] == 5 and by_batch[-1] == 0
    assert by_batch == sorted(by_batch, reverse=True)  # never more drafts at a larger batch
    assert choose_num_drafts(5, 0.0, 1, 0, cost) == 0  # nothing accepted: nothing drafted
    for batch in range(1, 300, 7):  # whatever it picks promises at least not speculating's rate
        k = choose_num_drafts(5, 0.5, batch, 0, cost)
        rate = batch * expected_tokens(k, 0.5) / cost.step_seconds(batch * k, batch)
        assert rate >= batch / cost.step_seconds(0, batch)


def test_acceptance_starts_at_the_prior_and_follows_what_is_observed() -> None:
    acceptance = Acceptance()
    assert acceptance.alpha == 0.5
    for _ in range(200):
        acceptance.observe(4, 1)
    assert acceptance.alpha == pytest.approx(0.25, abs=0.01)
    for _ in range(400):  # steps without drafts: back toward the prior, to be tried again
        acceptance.observe(0, 0)
    assert acceptance.alpha == pytest.approx(0.5, abs=0.01)
    assert expected_tokens(3, 1.0) == 4 and expected_tokens(3, 0.0) == 1


def test_serve_takes_speculative_config_as_json() -> None:
    from vllm_actors.cli import build_parser, engine_kwargs

    text = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
    kwargs = engine_kwargs(build_parser().parse_args(["serve", "--speculative-config", text]))
    assert kwargs["speculative_config"] == text
    spec = make_engine_config("m", kwargs).speculative_config
    assert spec is not None and (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min) == ("ngram", 3, 1)
    assert engine_kwargs(build_parser().parse_args(["serve"]))["speculative_config"] is None


def test_a_request_whose_text_never_matches_stops_holding_its_second_step() -> None:
    """Adaptive drafting: a speculating request waits for its step in flight (None); text without
    n-gram matches counts as rejected drafts, and within a few steps it decodes with two steps in
    flight again ([]), while repeating text keeps drafting."""
    from vllm_actors.actors.scheduler.request import ScheduledRequest
    from vllm_actors.actors.scheduler.speculation import Speculator
    from vllm_actors.protocol.sampling import SamplingParams
    from vllm_actors.protocol.speculative import SpeculativeConfig

    config = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=2)
    speculator = Speculator(config, FixedCostModel(a=0.010, b=0.0002, c=0.0001))

    def request(tokens: list[int], pending: int) -> ScheduledRequest:
        from vllm_actors.protocol.messages import pack_token_ids

        return ScheduledRequest(request_id="r", prompt_token_ids=tokens[:-1], output_token_ids=tokens[-1:],
                                params=SamplingParams(temperature=0.0), eos_token_ids=[], num_pending=pending,
                                packed_prompt=pack_token_ids(tokens[:-1]))

    plain = list(range(1, 40))
    assert speculator.drafts(request(plain, 1), 64, 1000, 1) is None  # waits for its step in flight
    misses = 0
    while speculator.drafts(request(plain, 1), 64, 1000, 1) is None:
        speculator.begin_pass()
        assert speculator.drafts(request(plain, 0), 64, 1000, 1) == []  # nothing to draft: a miss
        misses += 1
        assert misses < 10
    assert misses >= 1
    repeating = [5, 6, 7, 8, 9, 5, 6, 7]
    fresh = Speculator(config, FixedCostModel(a=0.010, b=0.0002, c=0.0001))
    assert fresh.drafts(request(repeating, 0), 64, 1000, 1) == [8, 9, 5, 6]
