"""What every offline peer script shares (peer_vllm.py, peer_sglang.py): the sampling settings, the
client-clock batch-1 measurement, the workload file and the result file. Imports nothing of
vllm_actors: each peer script runs under its engine's own Python path, with this file copied beside
it (``peer_module``), and imports it as ``peer_common``.

``client_batch1`` measures with the client's clock only, the same way for every engine:
TTFT = median wall time of ``generate`` for one token of a ``--batch1-input-len`` prompt (no
prefix-cache hit: a fresh prompt each time); decode ms/token = (median wall time for
``--batch1-output-len`` tokens - TTFT) / (tokens - 1).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from collections.abc import Callable, Sequence
from typing import Any

TEMPERATURE = 0.6
BATCH1_REPEATS = 5


def client_batch1(
    generate: Callable[[list[int], int], float], input_len: int, output_len: int, seed: int, vocab_size: int,
    repeats: int = BATCH1_REPEATS,
) -> dict[str, Any]:
    """``generate(prompt, max_tokens) -> seconds``; every call gets a prompt of its own."""
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [rng.randint(0, 9999) % vocab_size for _ in range(input_len)]

    generate(prompt(), 2)  # first call of this shape out of the way
    ttfts = [generate(prompt(), 1) for _ in range(repeats)]
    fulls = [generate(prompt(), output_len) for _ in range(max(1, repeats // 2))]
    ttft, full = statistics.median(ttfts), statistics.median(fulls)
    return {"input_len": input_len, "output_len": output_len, "ttft_s": ttft, "full_s": full,
            "ms_per_token": (full - ttft) / max(1, output_len - 1) * 1e3, "ttft_samples_s": ttfts,
            "full_samples_s": fulls}


def common_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments every peer script takes (throughput_compare.run_engine_peer passes them)."""
    parser.add_argument("--model", required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--warmup-requests", type=int, default=4)
    parser.add_argument("--no-batch1", action="store_true")
    parser.add_argument("--batch1-input-len", type=int, default=1024)
    parser.add_argument("--batch1-output-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=151936)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--moe-router-skew", default=None, help="zipf:S (vLLM's peer: peer_vllm_skew.py)")
    return parser


def read_workload(path: str) -> dict[str, Any]:
    """``{"prompts": [[ids]], "max_tokens": [n], "mix": optional per-request fields}``."""
    with open(path) as handle:
        return dict(json.load(handle))


def write_result(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)


def summarise(result: dict[str, Any], num_requests: int, expected_output_tokens: int) -> None:
    """The best run's figures at the top level of ``result`` (what the report compares)."""
    best = max(result["runs"], key=lambda r: r["tokens_per_s"])
    result.update({"num_requests": num_requests, "output_tokens": best["output_tokens"], "seconds": best["seconds"],
                   "tokens_per_s": best["tokens_per_s"], "expected_output_tokens": expected_output_tokens})


Generate = Callable[[Sequence[Sequence[int]], Sequence[int], "Sequence[dict[str, Any]] | None"], tuple[int, float]]


def run_workload(name: str, generate: Generate, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """What the benchmark does to every engine, once it is up: a warm-up, ``--runs`` timed runs of
    the whole workload (with a mix: plain and mixed runs), then batch-1. ``generate(prompts, limits,
    extras) -> (output tokens, seconds)``; ``result`` is written to ``--out`` after every part."""
    workload = read_workload(args.workload)
    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    mix = workload.get("mix")  # per request: {"json": schema} or penalties (throughput_mix.py)
    result.setdefault("runs", [])
    if args.warmup_requests > 0:
        generate([prompts[i % len(prompts)][:64] for i in range(args.warmup_requests)], [16] * args.warmup_requests,
                 None)
    for run in range(args.runs):
        produced, seconds = generate(prompts, max_tokens, None)
        result["runs"].append({"output_tokens": produced, "seconds": seconds, "tokens_per_s": produced / seconds})
        print(f"{name} run {run + 1}: {produced} tokens in {seconds:.2f} s = {produced / seconds:,.0f} tok/s",
              flush=True)
        write_result(args.out, result)
    if mix is not None:  # the same workload with the mix, on the same engine
        result["plain"], result["mixed"] = result["runs"], []
        for run in range(args.runs):
            produced, seconds = generate(prompts, max_tokens, mix)
            result["mixed"].append({"output_tokens": produced, "seconds": seconds, "tokens_per_s": produced / seconds})
            print(f"{name} mixed run {run + 1}: {produced / seconds:,.0f} tok/s", flush=True)
            write_result(args.out, result)
        result["plain_tokens_per_s"] = max(r["tokens_per_s"] for r in result["plain"])
        result["mixed_tokens_per_s"] = max(r["tokens_per_s"] for r in result["mixed"])
        result["cost"] = 1.0 - result["mixed_tokens_per_s"] / result["plain_tokens_per_s"]
    summarise(result, len(prompts), sum(max_tokens))
    write_result(args.out, result)
    if not args.no_batch1:
        result["batch1"] = client_batch1(lambda p, n: generate([p], [n], None)[1], args.batch1_input_len,
                                         args.batch1_output_len, args.seed + 7, args.vocab_size)
        b1 = result["batch1"]
        print(f"{name} batch-1: TTFT {b1['ttft_s'] * 1e3:.1f} ms, {b1['ms_per_token']:.3f} ms/token", flush=True)
    write_result(args.out, result)
