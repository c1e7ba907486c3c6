"""``vllm-actors bench latency``: the end-to-end latency of one batch, as ``vllm bench latency`` measures it.

A batch of ``--batch-size`` prompts of ``--input-len`` random token ids, each generating exactly
``--output-len`` tokens (EOS ignored), goes through ``LLM.generate``: ``--num-iters-warmup``
batches untimed, then ``--num-iters`` timed ones. Reported: the mean and the 10th to 99th
percentiles of a batch's wall time; ``--output-json`` writes them with every sample.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_actors.bench.report import percentile
from vllm_actors.engine_args import add_engine_arguments, engine_kwargs

PERCENTILES = (10, 25, 50, 75, 90, 99)
TOKEN_ID_LIMIT = 10_000  # ordinary tokens of any large vocabulary, as vLLM draws them


@dataclass(frozen=True)
class LatencyResult:
    latencies: list[float]  # seconds per timed batch

    @property
    def avg_latency(self) -> float:
        return sum(self.latencies) / len(self.latencies)

    def percentiles(self) -> dict[int, float]:
        ordered = sorted(self.latencies)
        return {share: percentile(ordered, share / 100) for share in PERCENTILES}

    def to_dict(self) -> dict[str, Any]:
        return {"avg_latency": self.avg_latency, "latencies": list(self.latencies),
                "percentiles": {str(share): value for share, value in self.percentiles().items()}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-actors bench latency", description=__doc__.split("\n\n")[0])
    add_engine_arguments(parser)
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of each request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of each request")
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="untimed batches first")
    parser.add_argument("--num-iters", type=int, default=30, help="timed batches")
    parser.add_argument("--disable-detokenize", action="store_true", help="load no tokenizer: token ids only")
    parser.add_argument("--output-json", default=None, metavar="PATH", help="write the latencies as JSON")
    return parser


def dummy_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    limit = min(TOKEN_ID_LIMIT, vocab_size)
    return [[rng.randrange(limit) for _ in range(input_len)] for _ in range(batch_size)]


def measure(llm: Any, prompts: list[list[int]], output_len: int, warmup: int, iters: int) -> LatencyResult:
    """``warmup`` untimed batches, then ``iters`` timed ones; raises if a request stopped short."""
    from vllm_actors.protocol.sampling import SamplingParams

    params = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)
    inputs = [{"prompt_token_ids": prompt} for prompt in prompts]

    def one_batch() -> float:
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        counts = [len(output.outputs[0].token_ids) for output in outputs]
        short = [count for count in counts if count != output_len]
        if short:
            raise RuntimeError(f"requests produced {short} tokens, not {output_len}")
        return seconds

    for _ in range(warmup):
        one_batch()
    return LatencyResult([one_batch() for _ in range(iters)])


def format_result(result: LatencyResult) -> str:
    lines = [f"Avg latency: {result.avg_latency} seconds"]
    lines += [f"{share}% percentile latency: {value} seconds" for share, value in result.percentiles().items()]
    return "\n".join(lines)


def _vocab_size(model: str | None) -> int:
    from vllm_actors.default_model import default_model_path
    from vllm_actors.models.config import ModelConfig

    return int(ModelConfig.from_path(model or default_model_path()).vocab_size)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.num_iters_warmup < 0:
        parser.error("--num-iters-warmup must be at least 0")
    from vllm_actors.llm import LLM

    prompts = dummy_prompts(args.batch_size, args.input_len, _vocab_size(args.model), args.seed)
    with LLM(args.model, skip_tokenizer_init=args.disable_detokenize, **engine_kwargs(args)) as llm:
        result = measure(llm, prompts, args.output_len, args.num_iters_warmup, args.num_iters)
    sys.stdout.write(format_result(result) + "\n")
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=4) + "\n")
    return 0
