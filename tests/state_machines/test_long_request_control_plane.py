"""The control plane does not notice a 1M-token request: per chunk, the bytes of the plan, of the
plan forwarded to the workers, of the step result and of the event batch are those of a 10k-token
request's chunk, and so is the CPU time of the scheduler, the KV-cache manager and the codec
(in process, prefix caching on: block hashing and the prefix tree included; no GPU).

CPU time is compared as a ratio, the 1M request's late chunks against the 10k request's chunks on
the same machine in the same process, so the machine's speed cancels out; a cost that grows with
the context (a walk of the request's blocks per chunk) makes the late chunks of 1M tokens, with
60,000 blocks behind them, several times dearer than a 10k request's. Against the GPU: the median
chunk's CPU is held to 1% of the chunk's GPU time as a cost model fitted to the Llama-3.2-1B shape
on an H100 predicts it (1M tokens prefilled in about 200 s); the CPU measured here (a shared,
slow machine) is about a sixth of that bound, and a GPU host's CPU is usually faster."""

from __future__ import annotations

import statistics

import pytest

from tests.support.long_request import ChunkCost, prompt_of, run_long_request
from vllm_actors.actors.scheduler.cost_model import FixedCostModel, chunk_pairs

CHUNK = 1024
SHORT, LONG = 10_000, 1_000_000
# 5 ms a step, 40k prefill tokens/s, attention fitted so the 1M prefill takes about 200 s.
LLAMA_1B_H100 = FixedCostModel(a=0.005, b=2.5e-5, c=1e-4, d=3.6e-4)


@pytest.fixture(scope="module")
def runs() -> dict[int, list[ChunkCost]]:
    prompt = prompt_of(LONG)  # the 10k prompt is its first 10k tokens: same blocks, same hashes
    return {length: run_long_request(prompt[:length], CHUNK, LONG // 16 + 1024, max_tokens=4)
            for length in (SHORT, LONG)}


def full_chunks(costs: list[ChunkCost]) -> list[ChunkCost]:
    """The prefill chunks after the first (which carries the prompt to the worker, once)."""
    return [cost for cost in costs[1:] if cost.num_tokens == CHUNK]


def test_bytes_per_chunk_do_not_grow_with_the_context(runs: dict[int, list[ChunkCost]]) -> None:
    short, long = full_chunks(runs[SHORT]), full_chunks(runs[LONG])
    assert len(short) >= 8 and len(long) >= 900
    for a, b in zip(short, long, strict=False):  # the same chunks of the same tokens: the same bytes
        assert (a.plan_bytes, a.forwarded_bytes, a.result_bytes, a.event_bytes) == (
            b.plan_bytes, b.forwarded_bytes, b.result_bytes, b.event_bytes)
    reference = short[-1]
    for cost in long:  # later chunks differ only by wider integers (step ids, positions)
        for field in ("plan_bytes", "forwarded_bytes", "result_bytes", "event_bytes"):
            assert getattr(cost, field) <= getattr(reference, field) + 16, (cost, field)
    decodes = [[c for c in runs[length] if c.num_tokens == 1] for length in (SHORT, LONG)]
    assert len(decodes[0]) == len(decodes[1]) >= 3
    for a, b in zip(*decodes, strict=True):
        assert b.plan_bytes <= a.plan_bytes + 16 and b.event_bytes <= a.event_bytes + 16


def test_cpu_per_chunk_does_not_grow_with_the_context(runs: dict[int, list[ChunkCost]]) -> None:
    short = statistics.median(c.cpu_seconds for c in full_chunks(runs[SHORT]))
    long = full_chunks(runs[LONG])
    late = statistics.median(c.cpu_seconds for c in long[3 * len(long) // 4:])
    assert late <= 2.5 * short, (late, short)


def test_cpu_per_chunk_is_under_one_percent_of_its_gpu_time(runs: dict[int, list[ChunkCost]]) -> None:
    shares = [cost.cpu_seconds / LLAMA_1B_H100.step_seconds(CHUNK, 0, chunk_pairs(cost.computed - CHUNK, CHUNK))
              for cost in full_chunks(runs[LONG])]
    assert statistics.median(shares) <= 0.01, statistics.median(shares)
