"""On a GPU: speculative decoding with a draft model through the process group (the draft's decode
graphs and eager catch-ups, the target's verification) gives the tokens decoding without it gives
(greedy, seeded and logprob rows, a penalised row); the target as its own
draft has (nearly) every draft accepted.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh (or pytest -m gpu).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.tiny_models import build_checkpoint
from vllm_actors import LLM, SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = [[(i * 7 + j * 3) % 500 for j in range(5 + 23 * i)] for i in range(4)]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=48, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, presence_penalty=0.3),  # sees its drafts
]


@pytest.fixture(scope="module")
def one_layer_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("draft1"), "qwen3", tie_word_embeddings=True, seed=3,
                            shape={"num_hidden_layers": 1})


def _run(target: Path, draft: Path | None, enforce_eager: bool,
         params: list[SamplingParams]) -> tuple[list[list[int]], Any]:
    spec = None if draft is None else parse_speculative_config(
        {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}, adaptive=False)
    with LLM(str(target), dtype="float32", enforce_eager=enforce_eager, max_model_len=512,
             speculative_config=spec) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs], llm.get_metrics().spec_decode


def _first_difference(got: list[list[int]], expected: list[list[int]]) -> str:
    """Where the outputs part (a wrong token from the first rows, or a run that stopped short)."""
    for row, (ours, theirs) in enumerate(zip(got, expected, strict=True)):
        at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        if ours != theirs:
            return (f"row {row} parts at output {at}: {ours[at:at + 4]} against "
                    f"{theirs[at:at + 4]} ({len(ours)} and {len(theirs)} tokens)")
    return "none"


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_draft_model_on_gpu_gives_the_tokens_of_no_speculation(tiny_qwen3: Path, one_layer_draft: Path,
                                                                enforce_eager: bool) -> None:
    expected, _ = _run(tiny_qwen3, None, enforce_eager, PARAMS)
    got, spec = _run(tiny_qwen3, one_layer_draft, enforce_eager, PARAMS)
    assert got == expected, f"first difference: {_first_difference(got, expected)}; {spec}"
    assert spec.num_draft_tokens > 0


def test_the_target_as_its_own_draft_on_gpu_has_its_drafts_accepted(tiny_qwen3: Path) -> None:
    greedy = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)] * len(PROMPTS)
    expected, _ = _run(tiny_qwen3, None, False, greedy)
    got, spec = _run(tiny_qwen3, tiny_qwen3, False, greedy)
    assert got == expected, f"first difference: {_first_difference(got, expected)}; {spec}"
    # the draft's decode graphs and the target's verification pass differ in shape: float32 rounding
    # may flip a near tie, nothing more
    assert spec.num_accepted_tokens >= 0.95 * spec.num_draft_tokens > 0
