"""On two GPUs: PP=2 (NCCL point-to-point between the stages) greedy token-identical to PP=1 in
float32, with logprobs within 1e-3, on the tiny Qwen3 (tied embeddings: the last stage holds its
own LM head) and Llama checkpoints of the CPU tests; a 2,000-token prompt in chunks pipelined
through the stages (sequence pipeline parallelism) too. Each stage replays decode CUDA graphs (the
hand-over outside them): greedy and seeded sampled tokens the same as the stages run eagerly
(``enforce_eager``) and as PP=1.

Skipped without two CUDA devices; run on nvidia-h100-x2 by ``benchmarks/gpu_session.sh pp``.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_actors import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MAX_TOKENS = 24


def _prompts(vocab: int, count: int = 24, longest: int = 300) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, longest))] for _ in range(count)]


def _generate(path: Path, pp_size: int, prompts: list[list[int]], params: SamplingParams | None = None,
              captured: list[str] | None = None, **engine: Any) -> tuple[list[list[int]], Any]:
    """Tokens and logprobs; ``captured``: gets the workers that logged their CUDA graphs captured."""
    with LLM(str(path), dtype="float32", pipeline_parallel_size=pp_size, seed=0, **engine) as llm:
        params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        scored = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        if captured is not None and llm.group is not None:
            captured.extend(sorted(log.stem for log in Path(llm.group.log_dir).glob("worker-*.log")
                                   if "cuda_graphs_captured" in log.read_text(errors="replace")))
    logprobs = [[entry[token].logprob for entry, token in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids,
                                                               strict=True)] for o in scored]
    return [list(o.outputs[0].token_ids) for o in scored], logprobs


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3_tp", "tiny_llama_tp"])
def test_pp2_greedy_equals_pp1_on_two_gpus(checkpoint: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    prompts = _prompts(500)
    engine = dict(num_gpu_blocks_override=64, max_num_batched_tokens=256)  # preemption and chunks
    want, want_logprobs = _generate(path, 1, prompts, **engine)
    got, got_logprobs = _generate(path, 2, prompts, **engine)
    assert got == want
    for ours, theirs in zip(got_logprobs, want_logprobs, strict=True):
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


def test_pp2_long_prompt_in_many_chunks_equals_pp1(tiny_qwen3_tp: Path) -> None:
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(1000)], *_prompts(500, count=4)]  # the model's 1,024 positions
    # the long prompt in 16 chunks; a small pool, because the suite checks the pool's invariants at every
    # message and a whole GPU's pool of a tiny model (millions of blocks) made that take minutes
    engine = dict(max_num_batched_tokens=64, max_model_len=1024, num_gpu_blocks_override=256)
    want, _ = _generate(tiny_qwen3_tp, 1, prompts, **engine)
    got, _ = _generate(tiny_qwen3_tp, 2, prompts, **engine)
    assert got == want


def test_pp2_stages_replay_decode_graphs(tiny_qwen3_tp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_LOG_LEVEL", "INFO")  # cuda_graphs_captured is an INFO line (default: WARNING)
    prompts = _prompts(500, count=12, longest=120)
    engine = dict(num_gpu_blocks_override=64, max_num_batched_tokens=256)
    captured: list[str] = []
    graphs, graphs_logprobs = _generate(tiny_qwen3_tp, 2, prompts, captured=captured, **engine)
    assert captured == ["worker-0", "worker-1"], "every stage captures its decode graphs"
    eager, eager_logprobs = _generate(tiny_qwen3_tp, 2, prompts, enforce_eager=True, **engine)
    assert graphs == eager
    for ours, theirs in zip(graphs_logprobs, eager_logprobs, strict=True):
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3
    # seeded sampling: the last stage's graphs draw the tokens (the graph sampler), as PP=1's do
    sampled = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    want, _ = _generate(tiny_qwen3_tp, 1, prompts, params=sampled, **engine)
    got, _ = _generate(tiny_qwen3_tp, 2, prompts, params=sampled, **engine)
    assert got == want
