"""The oracle benchmark's model (``VLLM_ACTORS_DUMMY_WEIGHTS=echo``: dummy weights whose greedy output
does not hang on rounding) on a tiny Qwen3 of the 8B's kind (untied head), in bfloat16: greedy
decoding repeats the last prompt token by a wide logit margin where the random dummy weights tie;
the oracle at acceptance 1 gives the output of no speculation with every draft kept (1 + k tokens a
step), and at a set acceptance measures it within a tolerance (``benchmarks/lib/spec_oracle.py``)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from benchmarks.lib import spec_oracle

from vllm_actors import LLM, SamplingParams
from vllm_actors.bench.throughput_workload import QWEN3_8B_CONFIG, write_model_dir
from vllm_actors.protocol.speculative import parse_speculative_config

TINY_8B = {**QWEN3_8B_CONFIG, "vocab_size": 2048, "hidden_size": 128, "intermediate_size": 256,
           "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
           "bos_token_id": 1, "eos_token_id": 2}
ARGS = {"load_format": "dummy", "dtype": "bfloat16", "executor": "inprocess", "block_size": 4, "max_model_len": 256,
        "max_num_batched_tokens": 64, "num_gpu_blocks_override": 200, "skip_tokenizer_init": True}
PROMPTS = [[random.Random(i).randrange(100, 2000) for _ in range(8 + i)] for i in range(4)]
MAX_TOKENS = 48
K = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny_qwen3_8b_shape"), TINY_8B)


@pytest.fixture
def echo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("VLLM_ACTORS_DUMMY_WEIGHTS", "echo")
    monkeypatch.setenv("VLLM_ACTORS_ALLOW_ORACLE_DRAFTER", "1")
    yield


def generate(llm: LLM, logprobs: int | None = None, max_tokens: int = MAX_TOKENS) -> list[Any]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0] for p in PROMPTS]


def margins(output: Any) -> list[float]:
    """Each position's lead of the greedy token's logprob over the runner-up's."""
    found = []
    for position in output.logprobs:
        first, second = sorted((entry.logprob for entry in position.values()), reverse=True)[:2]
        found.append(first - second)
    return found


def test_random_dummy_weights_tie_where_echo_weights_lead_by_a_margin(model_dir: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with LLM(str(model_dir), **ARGS) as llm:
        random_margin = min(min(margins(o)) for o in generate(llm, logprobs=2, max_tokens=16))
    monkeypatch.setenv("VLLM_ACTORS_DUMMY_WEIGHTS", "echo")
    with LLM(str(model_dir), **ARGS) as llm:
        outputs = generate(llm, logprobs=2, max_tokens=16)
    assert random_margin < 0.05  # near ties: which token wins hangs on the kernels' rounding
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        assert list(output.token_ids) == [prompt[-1]] * 16
        assert min(margins(output)) > 1.0  # bfloat16 rounds these logits by less than 0.02


@pytest.mark.usefixtures("echo")
def test_the_oracle_on_echo_weights_is_exact_and_measures_the_set_acceptance(model_dir: Path) -> None:
    with LLM(str(model_dir), **ARGS) as llm:
        recorded = [list(o.token_ids) for o in generate(llm)]
    spec: dict[str, Any] = {"method": "oracle", "num_speculative_tokens": K, "oracle_seed": 3,
                            "oracle_tokens": [[p, o] for p, o in zip(PROMPTS, recorded, strict=True)]}
    for acceptance, tolerance in ((1.0, 0.0), (0.6, 0.08)):  # k drafts every step, as the benchmark runs it
        config = parse_speculative_config(spec | {"oracle_acceptance": acceptance}, adaptive=False)
        with LLM(str(model_dir), speculative_config=config, **ARGS) as llm:
            outputs = [list(o.token_ids) for o in generate(llm)]
            counts = spec_oracle.counts(llm)
        assert outputs == recorded
        zero = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": [0] * K}
        tokens = [(len(o), 1.0) for o in outputs]
        found = spec_oracle.summarize(zero, counts, tokens, K, None)
        assert abs(found["measured_acceptance"] - acceptance) <= tolerance, found
        if acceptance == 1.0:  # every step past the prefill's keeps its k drafts
            assert counts["num_accepted_tokens"] == counts["num_draft_tokens"]
            assert found["mean_acceptance_length"] > 1 + K - 0.3, found  # tokens per drafting step


@pytest.mark.usefixtures("echo")
def test_a_draft_model_on_echo_weights_has_every_draft_right(model_dir: Path, tmp_path: Path) -> None:
    """``spec_decode.py --draft-layers N --dummy-weights echo``: a one-layer draft of the target's shape on echo
    weights drafts what the target decodes, so the draft path is measured at full acceptance (vLLM's dummy
    draft agrees with its dummy target likewise)."""
    draft = write_model_dir(tmp_path / "draft", {**TINY_8B, "num_hidden_layers": 1})
    config = parse_speculative_config({"method": "draft_model", "model": str(draft), "num_speculative_tokens": K},
                                      adaptive=False)
    with LLM(str(model_dir), speculative_config=config, **ARGS) as llm:
        outputs = [list(o.token_ids) for o in generate(llm)]
        counts = spec_oracle.counts(llm)
    assert outputs == [[p[-1]] * MAX_TOKENS for p in PROMPTS]
    assert counts["num_draft_tokens"] > 0 and counts["num_accepted_tokens"] == counts["num_draft_tokens"]
