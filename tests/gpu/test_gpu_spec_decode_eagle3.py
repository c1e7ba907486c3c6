"""On a GPU: EAGLE-3 speculation through the process group (the target's hidden-state hook inside
its decode and padded CUDA graphs, the head's eager passes, the target's verification) gives the
tokens decoding without it gives (greedy, seeded and logprob rows, a penalised row that does not
speculate), with graphs and eagerly; the head's drafts match the plain-torch reference of vLLM's
proposer on the GPU's runner too.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh (or pytest -m gpu).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_spec_decode_eagle3 import build_head, reference_drafts
from tests.gpu.test_gpu_spec_decode_draft import PARAMS, PROMPTS
from vllm_actors import LLM, SamplingParams
from vllm_actors.protocol.speculative import parse_speculative_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def head(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_head(tiny_qwen3, tmp_path_factory.mktemp("eagle3") / "head")


def _run(target: Path, head: Path | None, enforce_eager: bool) -> tuple[list[list[int]], Any]:
    spec = None if head is None else parse_speculative_config(
        {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}, adaptive=False)
    with LLM(str(target), dtype="float32", enforce_eager=enforce_eager, max_model_len=512,
             speculative_config=spec) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs], llm.get_metrics().spec_decode


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_eagle3_on_gpu_gives_the_tokens_of_no_speculation(tiny_qwen3: Path, head: Path, enforce_eager: bool) -> None:
    expected, _ = _run(tiny_qwen3, None, enforce_eager)
    got, spec = _run(tiny_qwen3, head, enforce_eager)
    assert got == expected
    assert spec.num_draft_tokens > 0


def test_the_heads_drafts_on_gpu_are_the_references(tiny_qwen3: Path, head: Path) -> None:
    """The hook inside the target's CUDA graphs (a decode step replays one) stores the same fused
    states as the reference reads from transformers (float32: near ties aside, equal)."""
    from vllm_actors.actors.worker.eagle3 import Eagle3Proposer
    from vllm_actors.actors.worker.step_data import BatchInput, WorkerRequest
    from vllm_actors.protocol.config import EngineConfig
    from vllm_actors.protocol.messages import StepPlan
    from vllm_actors.protocol.speculative import WORKER_DRAFT
    from vllm_actors.runner.model_runner import ModelRunner

    spec = parse_speculative_config({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    runner = ModelRunner(EngineConfig(model=str(tiny_qwen3), dtype="float32", block_size=16, max_model_len=256,
                                      num_gpu_blocks_override=32, speculative_config=spec))
    proposer = Eagle3Proposer(runner.drafter)
    table = [3, 9]
    tokens = [(i * 37 + 5) % 500 for i in range(21)]
    runner.execute(BatchInput(tokens[:19], list(range(19)), [19], [19], [table], [18]))  # a prefill
    runner.execute(BatchInput(tokens[19:20], [19], [1], [20], [table], [0]))  # a decode step: its graph
    request = WorkerRequest("r", token_ids=tokens, num_prompt_tokens=19, num_output_tokens=2,
                            params=SamplingParams(), eos_token_ids=[], block_table=table)
    plan = StepPlan(step_id=0, req_ids=["r"], num_tokens=[4], new_block_ids=[[]],
                    draft_token_ids={"r": [WORKER_DRAFT] * 3})
    torch.cuda.synchronize()
    assert list(proposer.propose(plan, {"r": request}).draft_token_ids["r"]) == reference_drafts(
        tiny_qwen3, head, tokens, 3)
