"""The oracle drafter (speculative ``method: oracle``, benchmarks only), in process: at a set
acceptance the measured acceptance (accepted over reached draft positions) is near it, the outputs
are those of no speculation, no KV block is left behind (invariants after every step, and idle);
a continuation the outputs leave is learnt for the next run; the method is refused without its
setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_spec_decode import CopyingRunner
from vllm_actors import LLM, SamplingParams
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.engine_args import make_engine_config
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import StepFinished
from vllm_actors.protocol.speculative import SpeculativeConfig, parse_speculative_config

PROMPTS = [[(i * 11 + j * 5) % 97 for j in range(6 + i)] for i in range(8)]
MAX_TOKENS = 60
K = 4


def oracle(pairs: list[tuple[list[int], list[int]]], acceptance: float) -> SpeculativeConfig:
    return parse_speculative_config({"method": "oracle", "num_speculative_tokens": K, "oracle_tokens": pairs,
                                     "oracle_acceptance": acceptance, "oracle_seed": 7}, adaptive=False)


def make_engine(spec: SpeculativeConfig | None) -> tuple[InProcessEngine, list[StepFinished]]:
    config = EngineConfig(model="fake", block_size=4, max_num_batched_tokens=64, max_model_len=512,
                          speculative_config=spec)
    engine = InProcessEngine(config, serialize=True, runner=CopyingRunner(num_blocks=48, block_size=4),
                             tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    steps: list[StepFinished] = []
    engine.event_listeners.append(lambda batch: steps.extend(e for e in batch.events if isinstance(e, StepFinished)))
    return engine, steps


def one_at_a_time(engine: InProcessEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs, each request alone (batch 1: a step's counts are one request's)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs: list[list[int]] = []
    for index, prompt in enumerate(prompts):
        engine.submit(engine.prepare(f"r{index}-{len(outputs)}", {"prompt_token_ids": prompt}, params))
        while engine.has_unfinished:
            outputs.extend(list(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    engine.check_idle_invariants()
    return outputs


def measured(steps: list[StepFinished]) -> tuple[int, int]:
    """(accepted, reached) draft positions: a step reaches its accepted drafts and its first rejected one."""
    accepted = sum(step.num_accepted_tokens for step in steps)
    rejecting = sum(1 for step in steps if step.num_accepted_tokens < step.num_draft_tokens)
    return accepted, accepted + rejecting


@pytest.fixture(scope="module")
def recorded() -> list[list[int]]:
    return one_at_a_time(make_engine(None)[0], PROMPTS)


@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_measured_acceptance_is_the_set_one_and_outputs_are_exact(recorded: list[list[int]],
                                                                   acceptance: float) -> None:
    engine, steps = make_engine(oracle(list(zip(PROMPTS, recorded, strict=True)), acceptance))
    assert one_at_a_time(engine, PROMPTS) == recorded
    accepted, reached = measured(steps)
    drafted = sum(step.num_draft_tokens for step in steps)
    assert drafted >= K * len(PROMPTS)
    assert abs(accepted / reached - acceptance) < 0.06, (accepted, reached)
    if acceptance == 1.0:  # every step drafts K (or what max_tokens leaves) and keeps them all
        assert accepted == drafted


def test_a_continuation_the_outputs_leave_is_learnt(recorded: list[list[int]]) -> None:
    """Drafting stops where the output leaves a wrong continuation; the next run of that prompt
    drafts from the output instead, every position of it."""
    wrong = recorded[0][:20] + [(token + 1) % 97 for token in recorded[0][20:]]
    engine, steps = make_engine(oracle([(PROMPTS[0], wrong)], 1.0))
    assert one_at_a_time(engine, PROMPTS[:1]) == recorded[:1]
    first = sum(step.num_accepted_tokens for step in steps)
    assert 0 < first < 20
    steps.clear()
    assert one_at_a_time(engine, PROMPTS[:1]) == recorded[:1]
    accepted, drafted = (sum(step.num_accepted_tokens for step in steps), sum(step.num_draft_tokens for step in steps))
    assert accepted == drafted  # no draft rejected
    # every token after the first two (the prefill's, the decode planned beside it) from a drafting step
    assert accepted + sum(step.num_drafts for step in steps) == MAX_TOKENS - 2


def test_the_oracle_needs_its_setting_and_good_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    given = {"method": "oracle", "num_speculative_tokens": 2, "oracle_tokens": [[[1, 2], [3, 4]]],
             "oracle_acceptance": 0.5}
    monkeypatch.delenv("VLLM_ACTORS_ALLOW_ORACLE_DRAFTER", raising=False)
    with pytest.raises(ValueError, match="VLLM_ACTORS_ALLOW_ORACLE_DRAFTER=1"):
        make_engine_config("m", {"speculative_config": given})
    monkeypatch.setenv("VLLM_ACTORS_ALLOW_ORACLE_DRAFTER", "1")
    spec = make_engine_config("m", {"speculative_config": given}).speculative_config
    assert spec is not None and spec.oracle_tokens == (((1, 2), (3, 4)),) and spec.oracle_acceptance == 0.5
    for bad, message in (({"oracle_acceptance": 1.5}, "from 0 to 1"), ({"oracle_tokens": [[1, 2]]}, "pairs"),
                         ({"oracle_seed": "x"}, "integer"), ({"prompt_lookup_max": 3}, "takes no")):
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(given | bad)
    with pytest.raises(ValueError, match="are for method 'oracle'"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "oracle_acceptance": 0.5})


def test_tiny_qwen3_oracle_is_exact(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through LLM and the real model's verification: the tokens of no speculation, drafts accepted."""
    monkeypatch.setenv("VLLM_ACTORS_ALLOW_ORACLE_DRAFTER", "1")
    monkeypatch.setenv("VLLM_ACTORS_SPEC_ADAPTIVE", "0")
    prompts = [[(i * 7 + j * 3) % 500 for j in range(5 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    args = {"dtype": "float32", "executor": "inprocess", "block_size": 4, "max_model_len": 128,
            "max_num_batched_tokens": 32, "num_gpu_blocks_override": 40}
    with LLM(str(tiny_qwen3), **args) as llm:
        expected = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    spec = {"method": "oracle", "num_speculative_tokens": 3, "oracle_acceptance": 0.6,
            "oracle_tokens": [[p, o] for p, o in zip(prompts, expected, strict=True)]}
    with LLM(str(tiny_qwen3), speculative_config=spec, **args) as llm:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        counts = llm.get_metrics().spec_decode
    assert got == expected
    assert 0 < counts.num_accepted_tokens < counts.num_draft_tokens
