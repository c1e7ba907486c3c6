"""On a GPU: a long prefill whose chunks draw no token runs ahead of nothing. Each step's integer
inputs pass through the runner's two pinned staging sets, so the host may prepare at most one step
beyond the one the device runs; a deferred chunk that draws no token is fenced on the device (its
result waits for it), like a step that draws. Here every step is queued behind GPU work of its
own (``torch.cuda._sleep``), so an unfenced host would plan chunks far ahead of the device and
refill the inputs of chunks still queued: the greedy tokens would differ from those of the same
prefill read back chunk by chunk (prompt logprobs make every chunk read back at once)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_actors import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT, BUDGET = 900, 64  # 15 chunks, 14 of them drawing nothing (the tiny models take 1,024 positions)


def test_a_long_prefill_on_a_busy_gpu_gives_the_tokens_of_one_read_back_chunk_by_chunk(tiny_qwen3: Path) -> None:
    with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32", enable_prefix_caching=False,
             max_num_batched_tokens=BUDGET, seed=0) as llm:
        engine: Any = llm.engine  # the in-process engine: its worker's runner
        runner = engine.worker.runner
        execute = runner.execute

        def busy(batch: Any) -> torch.Tensor:
            torch.cuda._sleep(20_000_000)  # about 10 ms of device time queued ahead of the step's input copies
            return execute(batch)

        runner.execute = busy
        prompt = [random.Random(5).randrange(llm.vocab_size) for _ in range(PROMPT)]
        greedy = SamplingParams(temperature=0.0, max_tokens=8)
        deferred = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0]
        read_back = llm.generate({"prompt_token_ids": prompt}, greedy.clone(prompt_logprobs=1), use_tqdm=False)[0]
    assert deferred.outputs[0].token_ids == read_back.outputs[0].token_ids
