"""Speculative decoding's benchmark, engine-neutral: the prompt-copying workload and the timing loop
(``benchmarks/spec_decode.py`` runs it on this engine, ``peer_spec.py`` on vLLM). Imports nothing of
vllm_actors, so vLLM's side runs it under vLLM's own environment.

The workload: each prompt asks the model to copy a passage back (an edit that changes nothing); the
outputs quote their prompts, which is where n-gram drafts are accepted. Greedy, EOS ignored, so
every engine and mode generates the same number of tokens.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

WORDS = ("the model copies this passage with care while the river runs past old stone walls and quiet "
         "fields where farmers count their sheep before winter comes to the valley and every lamp in town "
         "is lit one by one as the evening bell rings twice").split()

# (prompts as token ids, max tokens) -> (tokens generated, seconds)
Generate = Callable[[Sequence[Sequence[int]], int], tuple[int, float]]


def passages(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(count)]


def copy_messages(passage: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{passage}"}]


def measure(generate: Generate, prompts: Sequence[Sequence[int]], output_len: int, repeats: int,
            concurrency: Sequence[int]) -> dict[str, Any]:
    """Batch 1: ``repeats`` requests one at a time, median ms per output token; then each
    concurrency: that many requests in one call, output tokens per second."""
    generate([prompts[0]], 8)  # warm-up
    samples = []
    for index in range(repeats):
        tokens, seconds = generate([prompts[index % len(prompts)]], output_len)
        samples.append(seconds * 1e3 / max(tokens, 1))
    result: dict[str, Any] = {"batch1_ms_per_token": statistics.median(samples), "batch1_samples": samples}
    for count in concurrency:
        batch = [prompts[index % len(prompts)] for index in range(count)]
        tokens, seconds = generate(batch, output_len)
        result[f"concurrency_{count}_tok_s"] = tokens / seconds
    return result


def timed(call: Callable[[], int]) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = call()
    return tokens, time.perf_counter() - start
