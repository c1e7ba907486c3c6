"""SamplingParams validation and the batched sampler."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_actors.actors.worker.step_data import SamplingRow
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runner.sampler import Sampler

BAD_PARAMS = [
    ({"n": 0}, "n"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"seed": 2**63}, "seed"),  # signed 64-bit: -1 is a seed, as in vLLM
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop": [3]}, "stop"),
    ({"stop_token_ids": [-4]}, "stop_token_ids"),
    ({"logprobs": -2}, "logprobs"),  # -1 is the whole vocabulary; any count is taken (the server bounds it)
    ({"prompt_logprobs": -3}, "prompt_logprobs"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD_PARAMS)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_and_conveniences() -> None:
    params = SamplingParams(stop="###", top_k=-1)
    assert params.stop == ["###"] and params.top_k == 0
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams().greedy


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((rows, vocab), generator=generator) * 2.0


def test_greedy_takes_the_argmax() -> None:
    logits = _logits(4)
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, []) for _ in range(4)]
    result = Sampler(torch.device("cpu"))(logits, rows)
    assert result.token_ids == logits.argmax(dim=-1).tolist()


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    target = _logits(1, seed=7)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=30, seed=1234)
    alone = [
        Sampler(torch.device("cpu"), seed=0)(target, [SamplingRow(params, index, [])]).token_ids[0]
        for index in range(20)
    ]
    for companions, engine_seed in ((3, 1), (9, 2)):
        batch = torch.cat([_logits(companions, seed=companions), target])
        others = [SamplingRow(SamplingParams(temperature=1.0), 0, []) for _ in range(companions)]
        sampler = Sampler(torch.device("cpu"), seed=engine_seed)
        together = [
            sampler(batch, [*others, SamplingRow(params, index, [])]).token_ids[-1] for index in range(20)
        ]
        assert together == alone
    assert len(set(alone)) > 1  # it really samples


def test_top_k_top_p_min_p_restrict_the_support() -> None:
    logits = _logits(1, vocab=40, seed=3).repeat(400, 1)
    order = logits[0].argsort(descending=True).tolist()
    sampler = Sampler(torch.device("cpu"), seed=0)

    top_k = sampler(logits, [SamplingRow(SamplingParams(temperature=1.0, top_k=3), 0, [])] * 400)
    assert set(top_k.token_ids) <= set(order[:3]) and len(set(top_k.token_ids)) > 1

    probs = logits[0].softmax(-1)
    sorted_probs = probs[order]
    nucleus = int((sorted_probs.cumsum(0) < 0.6).sum().item()) + 1
    top_p = sampler(logits, [SamplingRow(SamplingParams(temperature=1.0, top_p=0.6), 0, [])] * 400)
    assert set(top_p.token_ids) <= set(order[:nucleus])

    allowed = {i for i in range(40) if probs[i] >= 0.3 * probs.max()}
    min_p = sampler(logits, [SamplingRow(SamplingParams(temperature=1.0, min_p=0.3), 0, [])] * 400)
    assert set(min_p.token_ids) <= allowed


def test_sampling_follows_the_distribution() -> None:
    logits = torch.tensor([[0.0, math.log(3.0), -100.0]]).repeat(6000, 1)
    result = Sampler(torch.device("cpu"), seed=0)(logits, [SamplingRow(SamplingParams(), 0, [])] * 6000)
    share = result.token_ids.count(1) / 6000
    assert abs(share - 0.75) < 0.03
    assert 2 not in result.token_ids


def test_min_tokens_masks_stop_ids_and_logprobs_are_raw() -> None:
    logits = _logits(2)
    best = int(logits[0].argmax())
    rows = [
        SamplingRow(SamplingParams(temperature=0.0, min_tokens=2, logprobs=3), 1, [best]),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=0), 0, [best]),
    ]
    result = Sampler(torch.device("cpu"))(logits, rows)
    assert result.token_ids[0] != best
    raw = torch.log_softmax(logits, -1)
    first = result.logprobs[0]
    assert first is not None and len(first.token_ids) == 4
    assert first.token_ids[0] == result.token_ids[0]
    assert math.isclose(first.logprobs[0], raw[0, result.token_ids[0]].item(), abs_tol=1e-6)
    assert first.ranks[0] == 2 and first.token_ids[1] == best
    second = result.logprobs[1]
    assert second is not None and second.token_ids == [int(logits[1].argmax())] and second.ranks == [1]
