"""Speculative decoding (n-gram) through the in-process engine on the fake model: outputs identical
to decoding without it (greedy and seeded sampling), drafts accepted and rejected, KV blocks of
rejected drafts given back (the invariants are checked after every step)."""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.support.fake_runner import FakeRunner
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import StepFinished
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config


class CopyingRunner(FakeRunner):
    """The fake model, copying its context with period 7 except where a hash of it says otherwise
    (one position in five): n-gram drafts are often right and sometimes wrong."""

    def next_token(self, context: list[int]) -> int:
        if len(context) > 7 and zlib.crc32(bytes(str(context), "ascii")) % 5:
            return context[-7]
        return super().next_token(context)


def make_engine(spec: dict[str, int | str] | None, num_blocks: int = 64, budget: int = 64,
                prefix_caching: bool = True,
                runner: FakeRunner | None = None) -> tuple[InProcessEngine, list[StepFinished]]:
    """``runner``: another fake model (block size 4) than ``CopyingRunner``."""
    runner = runner or CopyingRunner(num_blocks=num_blocks, block_size=4)
    config = EngineConfig(model="fake", block_size=4, max_num_batched_tokens=budget, max_model_len=512,
                          enable_prefix_caching=prefix_caching,
                          speculative_config=parse_speculative_config(spec, adaptive=False) if spec else None)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    steps: list[StepFinished] = []
    engine.event_listeners.append(lambda batch: steps.extend(e for e in batch.events if isinstance(e, StepFinished)))
    return engine, steps


def run(engine: InProcessEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt}, p))
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    engine.check_idle_invariants()
    return finished


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [[(i * 5 + j * 3) % 97 for j in range(9 + i)] for i in range(6)]


@pytest.mark.parametrize("num_blocks", [64, 18], ids=["roomy", "preempting"])
def test_ngram_outputs_equal_no_speculation_greedy_and_seeded(num_blocks: int) -> None:
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=30 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    expected = run(make_engine(None, num_blocks=num_blocks)[0], PROMPTS, params)
    engine, steps = make_engine(NGRAM, num_blocks=num_blocks)
    assert run(engine, PROMPTS, params) == expected
    drafted = sum(step.num_draft_tokens for step in steps)
    accepted = sum(step.num_accepted_tokens for step in steps)
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    counters = engine.scheduler.spec.counters  # type: ignore[union-attr]  # speculating engine
    assert (counters.num_draft_tokens, counters.num_accepted_tokens) == (drafted, accepted)
    assert sum(counters.accepted_per_pos) == accepted
    if num_blocks == 18:
        assert engine.scheduler.stats.num_preemptions > 0


def test_stops_min_tokens_and_chunked_prefill_under_speculation() -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=40, min_tokens=5 + i, stop_token_ids=[PROMPTS[i][2]])
              for i in range(len(PROMPTS))]
    expected = run(make_engine(None, budget=8)[0], PROMPTS, params)
    engine, steps = make_engine(NGRAM, budget=8)
    assert run(engine, PROMPTS, params) == expected
    assert sum(step.num_accepted_tokens for step in steps) > 0


@pytest.mark.parametrize("num_blocks", [256, 30], ids=["roomy", "preempting"])
def test_requests_with_logits_controls_speculate_with_the_outputs_of_no_speculation(num_blocks: int) -> None:
    """Penalties (pooled counts plus each verification row's drafts before it), logit bias, allowed
    ids and bad words over a model whose logits are close (1.5 / 1.0 / 0.5): the controls change
    the tokens, drafts are made and both kept and refused, and the outputs are those without
    speculation, greedy and seeded, through preemptions."""
    controls: list[dict[str, object]] = [
        {"repetition_penalty": 1.6}, {"frequency_penalty": 0.4}, {"presence_penalty": 0.7},
        {"logit_bias": {20: 0.8}}, {"allowed_token_ids": list(range(0, 97, 2)) + [20]},
        {"bad_words_token_ids": [[20], [PROMPTS[3][-1], 12]]},
        {"presence_penalty": 0.3, "frequency_penalty": 0.2, "logit_bias": {11: 0.4}},
    ]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=24 + i, ignore_eos=True,
                             **control)  # type: ignore[arg-type]
              for i, control in enumerate(controls)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(controls))]
    plain = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens, ignore_eos=True)
             for p in params]

    def engine(spec: dict[str, int | str] | None) -> tuple[InProcessEngine, list[StepFinished]]:
        return make_engine(spec, num_blocks=num_blocks, runner=BranchingRunner(num_blocks=num_blocks, block_size=4))

    expected = run(engine(None)[0], prompts, params)
    assert expected != run(engine(None)[0], prompts, plain)  # the controls matter here
    speculating, steps = engine(NGRAM)
    assert run(speculating, prompts, params) == expected
    drafted = sum(step.num_draft_tokens for step in steps)
    accepted = sum(step.num_accepted_tokens for step in steps)
    assert 0 < accepted < drafted
    if num_blocks == 30:
        assert speculating.scheduler.stats.num_preemptions > 0


class BranchingRunner(FakeRunner):
    """A fake model with a real distribution: after any context, three tokens with logits 1.5 (the
    token two back: copying, so n-gram drafts are often right), 1.0 and 0.5; every other -inf."""

    def candidates(self, context: list[int]) -> dict[int, float]:
        found: dict[int, float] = {}
        for token, logit in ((context[-2], 1.5), (sum(context) % 5 + 10, 1.0), (20, 0.5)):
            found.setdefault(token, logit)
        return found

    def next_logits(self, context: list[int]) -> torch.Tensor:
        logits = torch.full((self.vocab_size,), float("-inf"))
        for token, logit in self.candidates(context).items():
            logits[token] = logit
        return logits


def exact_distribution(runner: BranchingRunner, prompt: list[int], length: int) -> dict[tuple[int, ...], float]:
    """Every output sequence of ``length`` tokens and its probability under the fake model."""
    import math

    sequences: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown: dict[tuple[int, ...], float] = {}
        for sequence, probability in sequences.items():
            candidates = runner.candidates(prompt + list(sequence))
            total = sum(math.exp(logit) for logit in candidates.values())
            for token, logit in candidates.items():
                grown[(*sequence, token)] = grown.get((*sequence, token), 0.0) + probability * math.exp(logit) / total
        sequences = grown
    return sequences


def chi_square(observed: list[int], expected: list[float]) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, the cells expected fewer than 5 times
    pooled into one."""
    small = [i for i, e in enumerate(expected) if e < 5]
    cells = [(observed[i], expected[i]) for i in range(len(expected)) if expected[i] >= 5]
    cells.append((sum(observed[i] for i in small), sum(expected[i] for i in small)))
    cells = [(o, e) for o, e in cells if e > 0]
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; z is the normal's)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def test_sampled_outputs_follow_the_models_distribution_with_and_without_speculation() -> None:
    """Unseeded sampling (fresh noise per verified row): the frequencies of 600 four-token outputs
    against their exact probabilities (chi-square), speculating and not."""
    prompt, length, draws = [3, 4, 3, 4, 3, 4], 4, 600
    params = SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True)
    for spec in (None, NGRAM):
        runner = BranchingRunner(num_blocks=1024, block_size=4)
        config = EngineConfig(model="fake", block_size=4, max_num_batched_tokens=2048, max_model_len=64,
                              speculative_config=parse_speculative_config(spec, adaptive=False) if spec else None)
        engine = InProcessEngine(config, serialize=False, runner=runner, tokenizer=None)
        steps: list[StepFinished] = []
        engine.event_listeners.append(
            lambda batch, steps=steps: steps.extend(e for e in batch.events if isinstance(e, StepFinished)))
        outputs = run(engine, [prompt] * draws, [params] * draws)
        exact = exact_distribution(runner, prompt, length)
        seen: dict[tuple[int, ...], int] = {}
        for tokens in outputs.values():
            seen[tuple(tokens)] = seen.get(tuple(tokens), 0) + 1
        assert set(seen) <= set(exact)
        keys = sorted(exact)
        observed = [seen.get(key, 0) for key in keys]
        expected = [exact[key] * draws for key in keys]
        statistic, dof = chi_square(observed, expected)
        assert statistic < chi_square_critical(dof), (spec, statistic, dof)
        if spec is not None:
            accepted = sum(step.num_accepted_tokens for step in steps)
            assert 0 < accepted < sum(step.num_draft_tokens for step in steps)


@pytest.mark.parametrize("seed", [1, 2])
def test_restarts_n2_and_prefix_hits_under_speculation_give_the_same_outputs(seed: int) -> None:
    """The recovery tests' workload (greedy, seeded, n = 2, stops, shared prefixes) under speculation
    with a KV-manager, worker or scheduler restart every few steps: the outputs of a clean run
    without speculation."""
    from tests.support.recovery_runs import restart_kv_manager, restart_scheduler, restart_worker, workload
    from tests.support.recovery_runs import run as run_with_faults

    jobs = workload(seed)
    expected, _ = run_with_faults(make_engine(None, num_blocks=40, budget=24)[0], jobs)
    clean, num_steps = run_with_faults(make_engine(NGRAM, num_blocks=40, budget=24)[0], jobs)
    assert clean == expected
    engine, steps = make_engine(NGRAM, num_blocks=40, budget=24)
    cycle = [restart_kv_manager(), restart_worker("stale"), restart_scheduler()]
    # faults inside the run (as the recovery tests place them), one every third step
    got, _ = run_with_faults(engine, jobs, {k: cycle[(k // 3) % 3] for k in range(2, num_steps - 1, 3)})
    assert got == expected
    assert sum(step.num_accepted_tokens for step in steps) > 0


def test_the_next_plan_leaves_the_scheduler_before_the_clients_updates() -> None:
    """A speculating request's device idles from its result to its next plan: the scheduler sends
    the plan first, the client's updates (off that path) after it."""
    engine, _ = make_engine(NGRAM)
    loop = next(loop for loop in engine._loops if loop.actor.name == "scheduler")
    receive = loop.receive
    orders: list[list[str]] = []

    def recording(sender: bytes, message: object) -> object:
        sent = receive(sender, message)  # type: ignore[arg-type]  # the loop's own message
        if sent is not None:
            orders.append([type(outgoing).__name__ for _, outgoing in sent.messages])
        return sent

    loop.receive = recording  # type: ignore[method-assign]  # records what the scheduler sends
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    run(engine, [[1, 2, 3, 1, 2, 3, 1, 2]], params)
    both = [order for order in orders if {"StepPlan", "RequestUpdates"} <= set(order)]
    assert both and all(order.index("StepPlan") < order.index("RequestUpdates") for order in both)


def test_ngram_requests_keep_two_steps_in_flight_with_drafts_made_in_the_worker() -> None:
    """The scheduler plans an n-gram request's next step before its result is back (the worker
    drafts from the tokens it has by then): drafting plans in flight two at a time, the drafts
    accepted, the output as without speculation."""
    prompt, params = [5, 6, 7, 8] * 3, [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)]
    expected = run(make_engine(None)[0], [prompt], params)
    engine, steps = make_engine(NGRAM)
    loop = next(loop for loop in engine._loops if loop.actor.name == "scheduler")
    receive = loop.receive
    depths: list[int] = []

    def recording(sender: bytes, message: object) -> object:
        sent = receive(sender, message)  # type: ignore[arg-type]  # the loop's own message
        pipeline = engine.scheduler.pipeline
        depths.append(sum(1 for plan, _ in pipeline._in_flight if plan.draft_token_ids))
        return sent

    loop.receive = recording  # type: ignore[method-assign]  # records the drafting plans in flight
    assert run(engine, [prompt], params) == expected
    assert max(depths) == 2
    assert sum(step.num_accepted_tokens for step in steps) > 0
