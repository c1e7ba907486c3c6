"""``benchmarks/kv_quality.py``: what an fp8 KV cache does to a model's output, against the cache
in the model's dtype (float32 on the CPU, bf16 on a GPU).

One long text (the repository's docs, cut to ``--tokens`` tokens) is run through the model twice
per cache dtype:

* teacher forcing: the text in chunks of ``--chunk`` tokens (each chunk attends to the earlier
  ones through the paged cache, as a chunked prefill does), the logits of every position kept:
  top-1 agreement of the next-token prediction, mean |logit difference|, mean KL(reference || fp8),
  and each cache's perplexity of the text;
* greedy generation through the engine (``LLM``): ``--max-tokens`` tokens after the text; the share
  of positions whose token agrees and the first position that differs.

    python benchmarks/kv_quality.py [--model PATH] [--tokens 4000] [--max-tokens 256] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.protocol.config import EngineConfig

REPO = Path(__file__).resolve().parents[2]
# (label, kv_cache_dtype, calculate_kv_scales) compared with "auto"
VARIANTS = {
    "fp8": ("fp8", False),
    "fp8+calc": ("fp8", True),
    "fp8_e5m2": ("fp8_e5m2", False),
}


@dataclass
class ForcedStats:
    positions: int
    top1_agreement: float
    mean_abs_logit_diff: float
    mean_kl: float
    perplexity_reference: float
    perplexity: float


@dataclass
class GreedyStats:
    tokens: int
    agreement: float
    first_difference: int | None  # None: all agree


def long_text(tokenizer: Any, tokens: int) -> list[int]:
    """The first ``tokens`` tokens of the docs (README.md, then docs/*.md in name order)."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    ids = tokenizer.encode("\n\n".join(page.read_text(encoding="utf-8") for page in pages))
    if len(ids) < tokens:
        raise ValueError(f"the docs hold {len(ids)} tokens, fewer than the {tokens} asked for")
    return ids[:tokens]


def engine_config(args: argparse.Namespace, kv_cache_dtype: str, calculate: bool) -> dict[str, Any]:
    return {
        "dtype": args.dtype, "device": args.device, "kv_cache_dtype": kv_cache_dtype,
        "calculate_kv_scales": calculate, "max_model_len": args.tokens + args.max_tokens + args.chunk,
        "max_num_batched_tokens": args.chunk, "max_num_seqs": 1, "enable_prefix_caching": False,
    }  # fmt: skip


def forced_logits(runner: Any, ids: list[int], chunk: int) -> list[torch.Tensor]:
    """Float32 logits [chunk, vocab] of every position, the text fed ``chunk`` tokens a step."""
    table = list(range(-(-len(ids) // runner.block_size)))
    out = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        end = start + len(part)
        batch = BatchInput(part, list(range(start, end)), [len(part)], [end], [table], list(range(len(part))))
        out.append(runner.execute(batch).float().cpu())
    return out


def compare_forced(reference: list[torch.Tensor], other: list[torch.Tensor], ids: list[int]) -> ForcedStats:
    ref, got = torch.cat(reference)[:-1], torch.cat(other)[:-1]  # the last position predicts nothing here
    targets = torch.tensor(ids[1:])
    ref_logp, got_logp = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (ref_logp.exp() * (ref_logp - got_logp)).sum(-1)

    def perplexity(logp: torch.Tensor) -> float:
        return float(torch.exp(-logp.gather(1, targets[:, None]).mean()))

    return ForcedStats(
        positions=len(targets),
        top1_agreement=float((ref.argmax(-1) == got.argmax(-1)).float().mean()),
        mean_abs_logit_diff=float((ref - got).abs().mean()),
        mean_kl=float(kl.mean()),
        perplexity_reference=perplexity(ref_logp),
        perplexity=perplexity(got_logp),
    )


def greedy_tokens(model: str, ids: list[int], max_tokens: int, config: dict[str, Any]) -> list[int]:
    from vllm_actors import LLM, SamplingParams

    with LLM(model, executor="inprocess", **config) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        output = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return list(output.outputs[0].token_ids)


def compare_greedy(reference: list[int], other: list[int]) -> GreedyStats:
    same = [a == b for a, b in zip(reference, other)]
    return GreedyStats(len(same), sum(same) / max(1, len(same)), next((i for i, s in enumerate(same) if not s), None))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_actors.actors.frontend.tokenizer import load_tokenizer
    from vllm_actors.runner.model_runner import ModelRunner

    model = args.model
    if model is None:
        from vllm_actors.default_model import default_model_path

        model = default_model_path()
    ids = long_text(load_tokenizer(model), args.tokens)
    result: dict[str, Any] = {"model": model, "text_tokens": len(ids), "chunk": args.chunk,
                              "max_tokens": args.max_tokens, "variants": {}}
    started = time.perf_counter()
    reference_runner = ModelRunner(EngineConfig(model=model, **engine_config(args, "auto", False)))
    result["reference_kv_cache_dtype"] = str(reference_runner.kv_cache_dtype).removeprefix("torch.")
    reference = forced_logits(reference_runner, ids, args.chunk)
    del reference_runner
    reference_greedy = greedy_tokens(model, ids, args.max_tokens, engine_config(args, "auto", False))
    for label in args.variants:
        kv_cache_dtype, calculate = VARIANTS[label]
        config = engine_config(args, kv_cache_dtype, calculate)
        runner = ModelRunner(EngineConfig(model=model, **config))
        forced = compare_forced(reference, forced_logits(runner, ids, args.chunk), ids)
        del runner
        greedy = compare_greedy(reference_greedy, greedy_tokens(model, ids, args.max_tokens, config))
        result["variants"][label] = {"teacher_forcing": asdict(forced), "greedy": asdict(greedy)}
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"{result['text_tokens']} tokens of the docs, chunks of {result['chunk']}; greedy: {result['max_tokens']} "
        f"tokens after the text; reference: the {result['reference_kv_cache_dtype']} cache",
        "",
        "| KV cache | top-1 agreement | mean abs logit diff | mean KL | perplexity (ref / this) "
        "| greedy tokens agreeing | first greedy difference |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, stats in result["variants"].items():
        forced, greedy = stats["teacher_forcing"], stats["greedy"]
        lines.append(
            f"| {label} | {forced['top1_agreement']:.2%} | {forced['mean_abs_logit_diff']:.4f} "
            f"| {forced['mean_kl']:.2e} "
            f"| {forced['perplexity_reference']:.3f} / {forced['perplexity']:.3f} | {greedy['agreement']:.2%} "
            f"| {greedy['first_difference'] if greedy['first_difference'] is not None else 'none'} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="benchmarks/kv_quality.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--tokens", type=int, default=4000, help="tokens of text (teacher forcing and the prompt)")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per teacher-forcing step")
    parser.add_argument("--max-tokens", type=int, default=256, help="greedy tokens generated after the text")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--out", type=Path, default=None, help="write the result as JSON here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print(markdown(result))
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0
