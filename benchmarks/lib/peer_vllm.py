"""``benchmarks/throughput.py --peer vllm``: vLLM's offline ``LLM`` on the same workload, in a
process of its own (vLLM's packages live apart from this engine's, e.g. in /tmp/vsite).

This file runs as a script under vLLM's environment and imports nothing of vllm_actors:
``python3 peer_vllm.py --model DIR --workload W.json --out R.json`` (W.json: ``{"prompts":
[[ids]], "max_tokens": [n]}``). It does what the benchmark does to this engine: start the engine
(timed), a warm-up, ``--runs`` timed ``generate`` calls of the whole workload (temperature 0.6,
ignore_eos), then batch-1 (``client_batch1``, shared with our side).

``client_batch1`` measures with the client's clock only, the same way for both engines:
TTFT = median wall time of ``generate`` for one token of a ``--batch1-input-len`` prompt (no
prefix-cache hit: a fresh prompt each time); decode ms/token = (median wall time for
``--batch1-output-len`` tokens - TTFT) / (tokens - 1).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
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


def _extra(fields: dict[str, Any]) -> dict[str, Any]:
    """A request's mix fields as vLLM's SamplingParams arguments."""
    if "json" not in fields:
        return dict(fields)
    from vllm.sampling_params import StructuredOutputsParams

    return {"structured_outputs": StructuredOutputsParams(json=fields["json"])}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="vLLM's side of the throughput benchmark")
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
    return parser


def _write(path: str, result: dict[str, Any]) -> None:
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    import vllm
    from vllm import LLM, SamplingParams

    with open(args.workload) as handle:
        workload = json.load(handle)
    prompts, max_tokens = workload["prompts"], workload["max_tokens"]
    mix = workload.get("mix")  # per request: {"json": schema} or penalties (throughput_mix.py)
    result: dict[str, Any] = {"engine": "vllm", "version": vllm.__version__, "runs": [],
                              "python": sys.version.split()[0]}
    started = time.perf_counter()
    llm = LLM(model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization, seed=args.seed,
              enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching,
              skip_tokenizer_init=mix is None,  # structured outputs need the tokenizer
              tensor_parallel_size=args.tensor_parallel_size)
    result["startup_s"] = time.perf_counter() - started
    print(f"vllm {vllm.__version__}: engine up after {result['startup_s']:.1f} s", flush=True)

    def generate(batch: Sequence[Sequence[int]], limits: Sequence[int],
                 extras: Sequence[dict[str, Any]] | None = None) -> tuple[int, float]:
        inputs: list[Any] = [{"prompt_token_ids": list(p)} for p in batch]
        params = [SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n, detokenize=False,
                                 seed=None, **_extra(fields))
                  for n, fields in zip(limits, extras or [{}] * len(limits), strict=True)]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return sum(len(output.outputs[0].token_ids) for output in outputs), seconds

    if args.warmup_requests > 0:
        generate([prompts[i % len(prompts)][:64] for i in range(args.warmup_requests)], [16] * args.warmup_requests)
    for run in range(args.runs):
        produced, seconds = generate(prompts, max_tokens)
        result["runs"].append({"output_tokens": produced, "seconds": seconds, "tokens_per_s": produced / seconds})
        print(f"vllm run {run + 1}: {produced} tokens in {seconds:.2f} s = {produced / seconds:,.0f} tok/s", flush=True)
        _write(args.out, result)
    if mix is not None:  # the same workload with the mix, on the same engine (vLLM 0.26's spelling)
        result["plain"], result["mixed"] = result["runs"], []
        for run in range(args.runs):
            produced, seconds = generate(prompts, max_tokens, mix)
            result["mixed"].append({"output_tokens": produced, "seconds": seconds, "tokens_per_s": produced / seconds})
            print(f"vllm mixed run {run + 1}: {produced / seconds:,.0f} tok/s", flush=True)
            _write(args.out, result)
        result["plain_tokens_per_s"] = max(r["tokens_per_s"] for r in result["plain"])
        result["mixed_tokens_per_s"] = max(r["tokens_per_s"] for r in result["mixed"])
        result["cost"] = 1.0 - result["mixed_tokens_per_s"] / result["plain_tokens_per_s"]
    best = max(result["runs"], key=lambda r: r["tokens_per_s"])
    result.update({"num_requests": len(prompts), "output_tokens": best["output_tokens"], "seconds": best["seconds"],
                   "tokens_per_s": best["tokens_per_s"], "expected_output_tokens": sum(max_tokens)})
    _write(args.out, result)
    if not args.no_batch1:
        result["batch1"] = client_batch1(lambda p, n: generate([p], [n])[1], args.batch1_input_len,
                                         args.batch1_output_len, args.seed + 7, args.vocab_size)
        b1 = result["batch1"]
        print(f"vllm batch-1: TTFT {b1['ttft_s'] * 1e3:.1f} ms, {b1['ms_per_token']:.3f} ms/token", flush=True)
    _write(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
