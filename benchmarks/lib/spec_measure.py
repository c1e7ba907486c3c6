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
# () -> the engine's speculative-decoding totals (num_drafts, num_draft_tokens, num_accepted_tokens;
# accepted_per_pos optional)
Counters = Callable[[], dict[str, Any]]

QUEUED_PER_SLOT = 4  # ``queued``: requests per slot in one call (the queue behind the ones running)
WARMUP_TOKENS = 64  # the warm-up: one request of this many tokens, then a batch of WARMUP_BATCH
WARMUP_BATCH = 8


def passages(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "." for _ in range(count)]


def copy_messages(passage: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{passage}"}]


def measure(generate: Generate, prompts: Sequence[Sequence[int]], output_len: int, repeats: int,
            concurrency: Sequence[int], counters: Counters | None = None, batch_repeats: int = 1) -> dict[str, Any]:
    """Batch 1: ``repeats`` requests one at a time, median ms per output token; then each
    concurrency: that many requests in one call, output tokens per second. The warm-up is the same
    whatever the mode (a batch-1 request and a small batch, long enough for drafting steps to run);
    ``counters``: the engine's drafting per phase too (``phase_drafting``: what the policy chose)."""
    warm_up(generate, prompts)
    phases: dict[str, dict[str, Any]] = {}
    before = counters() if counters else {}
    samples, batch1_tokens = batch1(generate, prompts, output_len, repeats)
    if counters:
        phases["batch1"], before = drafting(before, after := counters(), batch1_tokens), after
    result: dict[str, Any] = {"batch1_ms_per_token": statistics.median(samples), "batch1_samples": samples}
    for count in concurrency:
        result[f"concurrency_{count}_tok_s"], tokens = concurrent(generate, prompts, count, output_len, batch_repeats)
        if counters:
            phases[f"concurrency_{count}"], before = drafting(before, after := counters(), tokens), after
    if counters:
        result["phase_drafting"] = phases
    return result


def warm_up(generate: Generate, prompts: Sequence[Sequence[int]]) -> None:
    """The same for every mode and engine: a batch-1 request, then a small batch."""
    generate([prompts[0]], WARMUP_TOKENS)
    generate([prompts[index % len(prompts)] for index in range(WARMUP_BATCH)], WARMUP_TOKENS // 2)


def batch1(generate: Generate, prompts: Sequence[Sequence[int]], output_len: int,
           repeats: int) -> tuple[list[float], int]:
    """``repeats`` requests one at a time: each one's ms per output token, and the tokens in all."""
    samples, tokens = [], 0
    for index in range(repeats):
        count, seconds = generate([prompts[index % len(prompts)]], output_len)
        tokens += count
        samples.append(seconds * 1e3 / max(count, 1))
    return samples, tokens


def concurrent(generate: Generate, prompts: Sequence[Sequence[int]], count: int,
               output_len: int, batch_repeats: int = 1) -> tuple[float, int]:
    """``count`` requests in one call, ``batch_repeats`` calls in a row: output tokens per second over
    them, and the tokens (a closed batch of 64 short outputs is ~0.4 s on an H200: one call's start and
    tail weigh on it)."""
    total_tokens, total_seconds = 0, 0.0
    for _ in range(batch_repeats):
        tokens, seconds = generate([prompts[index % len(prompts)] for index in range(count)], output_len)
        total_tokens, total_seconds = total_tokens + tokens, total_seconds + seconds
    return total_tokens / total_seconds, total_tokens


def queued(generate: Generate, prompts: Sequence[Sequence[int]], slots: int, output_len: int) -> tuple[float, int]:
    """``QUEUED_PER_SLOT`` x ``slots`` requests in one call to an engine started with ``max_num_seqs``
    ``slots`` (what ``vllm bench serve --max-concurrency N`` measures: each finished request's place is
    taken by the next): output tokens per second, and the tokens. A closed batch (``concurrent``) ends
    with its slowest request instead, whatever speculation gained the others: on this workload one
    prompt in five stops copying early (SmolLM2-135M's greedy output) and sets the batch's length."""
    batch = [prompts[index % len(prompts)] for index in range(QUEUED_PER_SLOT * slots)]
    tokens, seconds = generate(batch, output_len)
    return tokens / seconds, tokens


def drafting(before: dict[str, Any], after: dict[str, Any], tokens: int) -> dict[str, Any]:
    """A phase's drafting from the counters before and after it: request-steps that drafted
    (``num_drafts``), their drafts, the accepted ones, the mean drafts per drafting request-step
    (``mean_k``), the share of the request-steps that drafted (each request-step gave one token
    plus its accepted drafts) and the phase's tokens; ``accepted_per_pos`` too where the counters
    have it."""
    delta: dict[str, Any] = {key: after.get(key, 0) - before.get(key, 0)
                             for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    request_steps = max(tokens - delta["num_accepted_tokens"], 1)
    delta["mean_k"] = delta["num_draft_tokens"] / delta["num_drafts"] if delta["num_drafts"] else 0.0
    delta["drafting_share"] = delta["num_drafts"] / request_steps
    delta["tokens"] = tokens
    for key in ("steps", "drained_steps"):  # the engine's steps, and those launched with the pipeline drained
        if key in after:
            delta[key] = after[key] - before.get(key, 0)
    if "accepted_per_pos" in after:
        earlier = list(before.get("accepted_per_pos", []))
        delta["accepted_per_pos"] = [count - (earlier[pos] if pos < len(earlier) else 0)
                                     for pos, count in enumerate(after["accepted_per_pos"])]
    return delta


def timed(call: Callable[[], int]) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = call()
    return tokens, time.perf_counter() - start
