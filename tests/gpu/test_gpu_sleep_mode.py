"""On a GPU: vLLM's sleep mode through a process group. Level 1 frees at least 90% of the device
memory the engine held (weights to host memory, KV cache and CUDA graphs freed; only the worker's
CUDA context stays), level 2 as much; after each wake (KV pool made again, graphs captured again)
greedy outputs are token-identical to before.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from vllm_actors import SamplingParams
from vllm_actors.clients.async_client import AsyncEngineClient

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]


async def _greedy(client: AsyncEngineClient) -> list[list[int]]:
    outputs = []
    for index, prompt in enumerate(PROMPTS):
        final = None
        async for output in client.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24), f"p{index}"):
            final = output
        assert final is not None
        outputs.append(list(final.outputs[0].token_ids))
    return outputs


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_the_engines_memory_and_wake_restores_it(tiny_qwen3: Path, level: int) -> None:
    async def run() -> None:
        free_before = _free()
        client = await AsyncEngineClient.start(str(tiny_qwen3), dtype="float32", gpu_memory_utilization=0.5)
        try:
            before = await _greedy(client)
            free_serving = _free()
            held = free_before - free_serving
            assert held > 1 << 30  # the KV pool takes most of what the engine holds
            reply = await client.control("sleep", level=level)
            assert reply.error is None and reply.is_sleeping
            freed = _free() - free_serving
            assert freed >= 0.9 * held, (freed, held)
            assert (await client.control("wake_up")).error is None
            assert not (await client.control("is_sleeping")).is_sleeping
            assert abs(_free() - free_serving) < 0.05 * held  # all of it back
            assert await _greedy(client) == before
        finally:
            await client.shutdown()

    asyncio.run(run())
