"""On two GPUs: TP=2 (NCCL, CUDA graphs, deferred steps) greedy token-identical to TP=1 in float32,
with logprobs within 1e-3, on the tiny Qwen3 and Llama checkpoints of the CPU tests.

Skipped without two CUDA devices; run on nvidia-h200-x2 by ``benchmarks/gpu_session.sh tp``.
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


def _prompts(vocab: int, count: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 300))] for _ in range(count)]


def _generate(path: Path, tp_size: int, prompts: list[list[int]], **engine: Any) -> tuple[list[list[int]], Any]:
    with LLM(str(path), dtype="float32", tensor_parallel_size=tp_size, seed=0, **engine) as llm:
        inputs = [{"prompt_token_ids": p} for p in prompts]
        greedy = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                              use_tqdm=False)  # deferred steps, decode graphs
        scored = llm.generate(inputs, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                     logprobs=0), use_tqdm=False)
    logprobs = [[entry[token].logprob for entry, token in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids,
                                                               strict=True)] for o in scored]
    return [o.outputs[0].token_ids for o in greedy], ([o.outputs[0].token_ids for o in scored], logprobs)


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3_tp", "tiny_llama_tp", "tiny_qwen3"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_tp2_greedy_equals_tp1_on_two_gpus(checkpoint: str, enforce_eager: bool,
                                           request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    prompts = _prompts(500)
    engine = dict(enforce_eager=enforce_eager, num_gpu_blocks_override=64, max_num_batched_tokens=256)
    want, (want_scored, want_logprobs) = _generate(path, 1, prompts, **engine)
    got, (got_scored, got_logprobs) = _generate(path, 2, prompts, **engine)
    assert got == want
    assert got_scored == want_scored == want
    for ours, theirs in zip(got_logprobs, want_logprobs, strict=True):
        assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


@pytest.mark.parametrize("method", ["symm_mem", "nccl"])
def test_tp2_with_each_all_reduce_equals_tp1(tiny_llama_tp: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """VLLM_ACTORS_TP_ALLREDUCE=symm_mem with no lower bound: every all-reduce of the tiny model
    through the two-shot over symmetric memory (by default only those of 64 KiB and more); =nccl:
    none of them."""
    prompts = _prompts(500)
    engine = dict(num_gpu_blocks_override=64, max_num_batched_tokens=256)
    want, _ = _generate(tiny_llama_tp, 1, prompts, **engine)
    monkeypatch.setenv("VLLM_ACTORS_TP_ALLREDUCE", method)
    monkeypatch.setenv("VLLM_ACTORS_TP_SYMM_MIN_BYTES", "0")
    got, (_, logprobs) = _generate(tiny_llama_tp, 2, prompts, **engine)
    assert got == want
    assert all(len(row) == MAX_TOKENS for row in logprobs)


def test_tp2_ranks_draw_the_same_sampled_tokens_in_their_graphs(tiny_qwen3_tp: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank draws a sampling decode graph's tokens itself (no broadcast): with temperature,
    seeded and unseeded rows, the tokens equal those of rank 0 drawing alone and broadcasting
    (``VLLM_ACTORS_TP_GRAPH_SAMPLER=0``). A rank that drew other ids would feed its shard other
    inputs from then on, and the outputs would part."""
    prompts = _prompts(500, count=16)
    engine = dict(num_gpu_blocks_override=64, max_num_batched_tokens=256)
    params = [SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i if i % 2 else None)
              for i in range(len(prompts))]

    def run() -> list[list[int]]:
        with LLM(str(tiny_qwen3_tp), dtype="float32", tensor_parallel_size=2, seed=0, **engine) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    monkeypatch.setenv("VLLM_ACTORS_TP_GRAPH_SAMPLER", "1")
    each_rank = run()
    monkeypatch.setenv("VLLM_ACTORS_TP_GRAPH_SAMPLER", "0")
    broadcast = run()
    assert each_rank == broadcast
    assert len({tuple(tokens) for tokens in each_rank}) == len(prompts)
