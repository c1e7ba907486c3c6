"""The oracle mode of ``benchmarks/spec_decode.py``: batch-1 decode with the oracle drafter (speculative
``method: oracle``) at set acceptances, against no speculation, so the measured step cost is the
verification cost of ``1 + k`` positions at a known acceptance.

The off run records each batch-1 prompt's greedy output (``greedy_outputs``); each acceptance starts
an engine whose oracle replays them. On a GPU a verification step may round differently from a
decode step at a near tie, so the greedy output under drafts can leave the recorded one: each prompt
is run until its output equals the continuation it was drafted from (the oracle learns every run's
output), and only then timed. Batch 1 only (the oracle needs each prompt's continuation).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any


def counts(llm: Any) -> dict[str, Any]:
    """The engine's speculative-decoding totals (vLLM's spec_decode counters), its steps and those
    launched with the pipeline drained."""
    metrics = llm.get_metrics()
    spec = metrics.spec_decode
    return {"num_drafts": spec.num_drafts, "num_draft_tokens": spec.num_draft_tokens,
            "num_accepted_tokens": spec.num_accepted_tokens, "accepted_per_pos": list(spec.accepted_per_pos),
            "steps": metrics.steps, "drained_steps": metrics.drained_steps}


def greedy_outputs(llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy output, one request at a time (batch 1, EOS ignored)."""
    from vllm_actors import SamplingParams

    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)
    return [list(llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0].outputs[0].token_ids)
            for prompt in prompts]


def batch1_prompts(spec: dict[str, Any]) -> list[list[int]]:
    """The prompts ``spec_measure.measure`` times at batch 1, in its order."""
    prompts = spec["prompts"]
    return [prompts[index % len(prompts)] for index in range(spec["repeats"])]


def run_oracle(model: str, spec: dict[str, Any], acceptance: float, recorded: list[list[int]],
               num_speculative_tokens: int, max_passes: int, off_ms: float | None) -> dict[str, Any]:
    """One engine drafting with the oracle at ``acceptance``: calibrated, then the batch-1 prompts timed."""
    from vllm_actors import LLM
    from vllm_actors.protocol.speculative import parse_speculative_config

    os.environ["VLLM_ACTORS_ALLOW_ORACLE_DRAFTER"] = "1"  # the method is refused without it
    prompts = batch1_prompts(spec)
    config = parse_speculative_config({
        "method": "oracle", "num_speculative_tokens": num_speculative_tokens, "oracle_acceptance": acceptance,
        "oracle_tokens": [[list(p), list(o)] for p, o in zip(prompts, recorded, strict=True)]}, adaptive=False)
    with LLM(model, dtype="auto", max_model_len=spec["max_model_len"], enable_prefix_caching=False,
             load_format=spec["load_format"], skip_tokenizer_init=not spec["tokenizer"],
             speculative_config=config) as llm:
        passes = [calibrate(llm, prompt, truth, spec["output_len"], max_passes)
                  for prompt, truth in zip(prompts, recorded, strict=True)]
        before = counts(llm)
        samples, outputs = [], []
        for prompt in prompts:  # the calibration runs warmed the engine up
            start = time.perf_counter()
            outputs.append(greedy_outputs(llm, [prompt], spec["output_len"])[0])
            samples.append((len(outputs[-1]), time.perf_counter() - start))
        after = counts(llm)
    result = summarize(before, after, samples, num_speculative_tokens, off_ms)
    result["acceptance"] = acceptance
    result["calibration_passes"] = passes  # None: still leaving its continuation after max_passes
    result["first_difference_from_off"] = [first_difference(o, r) for o, r in zip(outputs, recorded, strict=True)]
    return result


def calibrate(llm: Any, prompt: Sequence[int], truth: list[int], output_len: int, max_passes: int) -> int | None:
    """Runs ``prompt`` until its output equals the continuation its drafts came from; the passes it took."""
    for passes in range(1, max_passes + 1):
        output = greedy_outputs(llm, [prompt], output_len)[0]
        if output == truth:
            return passes
        truth = output  # what the oracle learnt from this run, and drafts from next
    return None


def first_difference(output: list[int], recorded: list[int]) -> int | None:
    """The first output position that differs from no speculation's (None: none)."""
    for position, (a, b) in enumerate(zip(output, recorded, strict=False)):
        if a != b:
            return position
    return None if len(output) == len(recorded) else min(len(output), len(recorded))


def summarize(before: dict[str, Any], after: dict[str, Any], samples: list[tuple[int, float]], k: int,
              off_ms: float | None) -> dict[str, Any]:
    """The timed requests' figures from the counters' difference and (tokens, seconds) per request."""
    drafts = after["num_drafts"] - before["num_drafts"]
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    full = after["accepted_per_pos"][k - 1] - before["accepted_per_pos"][k - 1]  # steps that kept all k
    tokens = sum(count for count, _ in samples)
    seconds = sum(elapsed for _, elapsed in samples)
    steps = tokens - accepted  # each step gives its accepted drafts plus one token of the model's
    ms_per_token = statistics.median(elapsed * 1e3 / max(count, 1) for count, elapsed in samples)
    ms_per_step = seconds * 1e3 / max(steps, 1)
    result: dict[str, Any] = {
        "batch1_ms_per_token": ms_per_token, "ms_per_step": ms_per_step, "tokens_per_step": tokens / max(steps, 1),
        # accepted over reached draft positions (a step reaches its accepted drafts and its first rejected
        # one; a step cut short by max_tokens that kept all its drafts counts as rejecting: a slight underestimate)
        "measured_acceptance": accepted / max(drafts + accepted - full, 1),
        "draft_acceptance_rate": accepted / max(drafted, 1),  # vLLM's: accepted over drafted
        "mean_acceptance_length": 1 + accepted / max(drafts, 1),  # vLLM's: tokens per drafting step
        "batch1_samples": [elapsed * 1e3 / max(count, 1) for count, elapsed in samples],
        "spec_decode": {"num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted},
    }
    if off_ms:
        result["speedup_vs_off"] = off_ms / ms_per_token
        result["verification_cost"] = ms_per_step / off_ms  # a step of 1 + k positions over a decode step
        result["ideal_ms_per_token"] = off_ms / result["tokens_per_step"]  # were verification free
    return result


def markdown(off_ms: float | None, results: dict[str, dict[str, Any]], k: int) -> str:
    """A table of the oracle runs against no speculation."""
    lines = [f"Batch-1 decode, oracle drafter, k = {k} drafts per step; no speculation: "
             f"{off_ms:.2f} ms/token." if off_ms else f"Batch-1 decode, oracle drafter, k = {k}.", "",
             "| set acceptance | measured | tokens/step | ms/step | verification cost (x decode step) | "
             "ms/token | ideal ms/token | speedup | calibration passes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results.values():
        if "error" in result:
            lines.append(f"| {result.get('acceptance')} | error: {result['error']} |")
            continue
        lines.append(
            f"| {result['acceptance']:.2f} | {result['measured_acceptance']:.3f} | {result['tokens_per_step']:.2f} | "
            f"{result['ms_per_step']:.2f} | {_fmt(result.get('verification_cost'))} | "
            f"{result['batch1_ms_per_token']:.2f} | {_fmt(result.get('ideal_ms_per_token'))} | "
            f"{_fmt(result.get('speedup_vs_off'))} | {result['calibration_passes']} |")
    return "\n".join(lines) + "\n"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
