"""The fused sampling kernel (kernels/sampling.py) against torch in float64, and the sampler's use
of it. conftest.py sets TRITON_INTERPRET=1 without CUDA, so these run on the CPU."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.actors.worker.step_data import SamplingRow
from vllm_actors.kernels import sampling
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runner.sampler import Sampler, row_seed

pytestmark = pytest.mark.skipif(not sampling.HAVE_TRITON, reason="triton is not installed")


def _reference(logits: torch.Tensor, inv: torch.Tensor, noise: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    uniform = sampling.philox_uniform(seeds, logits.shape[1])
    return sampling.gumbel_argmax_torch(logits, inv, noise, sampling.gumbel_from_uniform(uniform))


def test_kernel_matches_float64_reference_with_the_same_noise() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 3000, generator=generator) * 3
    inv = torch.tensor([1.0, 1 / 0.6, 1 / 1.3, 1.0, 1 / 0.2, 1.0])
    noise = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    seeds = torch.tensor([0, 1, 12345, 7, 2**62 + 5, 2**63 - 1], dtype=torch.long)
    chosen = sampling.gumbel_argmax(logits, inv, noise, seeds)
    assert chosen.tolist() == _reference(logits, inv, noise, seeds).tolist()
    # the noise changes the choice for the sampled rows (it is really drawn), not for greedy ones
    assert chosen[3].item() == logits[3].argmax().item() and chosen[5].item() == logits[5].argmax().item()


def test_greedy_ties_take_the_lowest_index_and_masked_tokens_never_win() -> None:
    logits = torch.full((3, 17000), -1.0)
    logits[0, [16500, 4097, 17, 2100, 9000]] = 5.0  # ties in different lanes, blocks and vocabulary slices
    logits[1, :] = float("-inf")
    logits[1, 16999] = 0.0  # only the last token is allowed
    logits[2, 10:] = float("-inf")  # sampled row: only 0..9 allowed
    inv = torch.ones(3)
    noise = torch.tensor([0.0, 1.0, 1.0])
    chosen = sampling.gumbel_argmax(logits, inv, noise, torch.tensor([1, 2, 3])).tolist()
    assert chosen[0] == 17 and chosen[1] == 16999 and chosen[2] < 10


def test_draws_follow_softmax_of_logits_over_temperature() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    temperature = 0.7
    rows = 600
    seeds = torch.arange(rows, dtype=torch.long) * 7919 + 3
    # The torch reference draws what the kernel draws (the float64 test above): it tests the noise's
    # distribution in 0.1 s where 600 rows through the Triton interpreter took 8 s of CI.
    chosen = _reference(logits.repeat(rows, 1), torch.full((rows,), 1 / temperature), torch.ones(rows), seeds)
    counts = torch.bincount(chosen, minlength=6).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * rows
    chi_square = ((counts - expected) ** 2 / expected).sum().item()
    assert chi_square < 25.0  # 5 degrees of freedom: p < 1e-4 (the seeds are fixed: this is exact)


def test_fused_sampler_rows_depend_only_on_their_own_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "triton")
    sampler = Sampler(torch.device("cpu"), seed=0)
    assert sampler.fused
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 700, generator=generator)
    seeded = SamplingParams(temperature=0.8, seed=42)
    plain = SamplingParams(temperature=1.1)
    greedy = SamplingParams(temperature=0.0)
    result = sampler(logits, [SamplingRow(plain, 0, []), SamplingRow(seeded, 5, []), SamplingRow(greedy, 0, [])])
    # the seeded row draws from its (seed, output index) key: the same token alone, or elsewhere in a batch
    alone = sampler(logits[1:2], [SamplingRow(seeded, 5, [])])
    moved = sampler(
        logits[[0, 2, 1]], [SamplingRow(plain, 0, []), SamplingRow(greedy, 0, []), SamplingRow(seeded, 5, [])]
    )
    expected = _reference(
        logits[1:2], torch.tensor([1 / 0.8]), torch.ones(1), torch.tensor([row_seed(42, 5)], dtype=torch.long)
    ).item()
    assert result.token_ids[1] == alone.token_ids[0] == moved.token_ids[2] == expected
    assert result.token_ids[2] == moved.token_ids[1] == logits[2].argmax().item()


def test_min_tokens_mask_applies_before_the_fused_draw(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "triton")
    sampler = Sampler(torch.device("cpu"), seed=0)
    logits = torch.zeros(2, 50)
    logits[:, 7] = 50.0  # token 7 (the stop id) would always win
    params = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[7])
    result = sampler(logits, [SamplingRow(params, 0, [7]), SamplingRow(params, 3, [7])])
    assert result.token_ids[0] != 7 and result.token_ids[1] == 7


def test_filters_keep_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "triton")
    sampler = Sampler(torch.device("cpu"), seed=0)
    called: list[int] = []
    monkeypatch.setattr(sampling, "gumbel_argmax", lambda *args: called.append(1))
    logits = torch.randn(2, 30)
    result = sampler(logits, [SamplingRow(SamplingParams(top_k=3), 0, []), SamplingRow(SamplingParams(), 0, [])])
    assert not called and len(result.token_ids) == 2
    assert logits[0].topk(3).indices.tolist().count(result.token_ids[0]) == 1


def test_sampler_choice_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "fast")
    with pytest.raises(ValueError, match="VLLM_ACTORS_SAMPLER"):
        Sampler(torch.device("cpu"))


def test_a_rank_that_follows_rank_0s_draws_keeps_the_same_graph_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under TP every rank draws a sampling decode graph's tokens itself, so their Philox keys must
    agree; rank 0 also draws eager steps (filters, controls) that the others only follow."""
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "triton")
    leader, follower = Sampler(torch.device("cpu"), seed=3), Sampler(torch.device("cpu"), seed=3)
    plain, greedy = SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)
    steps = [
        ("graph", [plain, greedy]),
        ("eager", [plain, SamplingParams(temperature=0.9, top_p=0.5)]),  # torch path: no key
        ("eager", [plain, SamplingParams(temperature=0.7, presence_penalty=0.5)]),  # fused draw: a key
        ("eager", [greedy]),  # all greedy: no key
        ("graph", [plain, plain]),
        ("graph", [greedy]),
        ("eager", [SamplingParams(temperature=1.2, min_tokens=4, stop_token_ids=[1])]),  # fused: a key
        ("graph", [plain]),
    ]
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    graph_keys = []
    for kind, params in steps:
        rows = [SamplingRow(p, 0, [1]) for p in params]
        if kind == "graph":
            ours, theirs = leader.graph_params(rows), follower.graph_params(rows)
            assert ours is not None and theirs is not None and ours.seeds == theirs.seeds
            graph_keys.append(ours.seeds)
        else:
            leader(logits[: len(rows)], rows)
            follower.follow_draw(rows)
    assert len({tuple(keys) for keys in graph_keys if any(keys)}) == 3  # every sampled draw a new key
    lagging = Sampler(torch.device("cpu"), seed=3)  # one that skips the eager draws drifts apart
    for kind, params in steps:
        rows = [SamplingRow(p, 0, [1]) for p in params]
        if kind == "graph":
            lagging.graph_params(rows)
    assert lagging._draws != leader._draws
