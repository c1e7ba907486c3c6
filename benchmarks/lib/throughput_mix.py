"""``benchmarks/throughput.py --mix json-penalties``: nano-vllm's workload with every tenth
request held to a JSON schema (structured outputs) and the others carrying penalties (presence,
frequency, repetition), against the plain workload on the same engine in the same call (``--mix
json``: the schema's tenth alone, the rest plain; ``--mix penalties``: every request penalised); with
``--peer vllm`` the same two runs on vLLM (``peer_vllm.py`` reads the mix from the workload file).

Structured outputs need a tokenizer: with the default random-weights model the model directory
gets the embedded SmolLM2 tokenizer (49,152 tokens; the ids above it are never allowed in a
constrained row) and its EOS id, and both engines load it (so both runs of each engine pay for
detokenising alike; vLLM's runs keep ``detokenize=False``). EOS stays ignored, as in the plain
workload: a constrained row whose grammar has ended may only repeat EOS until ``max_tokens``. The
schema (an array of records) rarely ends within 100-1,024 tokens, so such rows stay constrained.

Results: ``mix.json`` under ``--out`` and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.bench.throughput_workload import QWEN3_0_6B_CONFIG, TEMPERATURE, Workload, write_model_dir

log = structlog.get_logger(__name__)

MIXES = ("none", "json-penalties", "json", "penalties")  # "json": the 10% alone, "penalties": every request
JSON_EVERY = 10  # request i carries the schema when i % 10 == 0: 10% of the workload
MIX_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "score": {"type": "number"},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "score", "active"],
        "additionalProperties": False,
    },
}
PENALTIES: dict[str, float] = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}


def mix_fields(mix: str, count: int) -> list[dict[str, Any]]:
    """Per request: ``{"json": schema text}`` or the penalties (``{}`` for the plain workload)."""
    if mix == "none":
        return [{} for _ in range(count)]
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    schema = json.dumps(MIX_SCHEMA)
    rest: dict[str, float] = {} if mix == "json" else PENALTIES
    return [{"json": schema} if index % JSON_EVERY == 0 and mix != "penalties" else dict(rest)
            for index in range(count)]


def our_params(fields: dict[str, Any], max_tokens: int) -> Any:
    from vllm_actors.protocol.sampling import SamplingParams, StructuredOutputs

    extra: dict[str, Any] = dict(fields)
    if "json" in extra:
        extra = {"structured_outputs": StructuredOutputs(json=extra.pop("json"))}
    return SamplingParams(temperature=TEMPERATURE, ignore_eos=True, max_tokens=max_tokens, **extra)


def write_model_dir_with_tokenizer(path: Path) -> Path:
    """Qwen3-0.6B's shape (random weights) plus the embedded SmolLM2 tokenizer, EOS set to its."""
    from vllm_actors.actors.frontend.tokenizer import load_tokenizer
    from vllm_actors.default_model import default_model_path

    tokenizer = load_tokenizer(default_model_path())
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    config = dict(QWEN3_0_6B_CONFIG, eos_token_id=eos, bos_token_id=bos if bos is not None else eos)
    write_model_dir(path, config)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token, "model_max_length": int(QWEN3_0_6B_CONFIG["max_position_embeddings"]),
    }, indent=2) + "\n")
    return path


def run_ours(args: argparse.Namespace, model_path: str, load_format: str, workload: Workload) -> dict[str, Any]:
    """Warm-up, then ``--runs`` x (plain, mixed) on one engine; the best of each."""
    from vllm_actors.bench.throughput_engine import make_llm

    result: dict[str, Any] = {"plain": [], "mixed": []}
    inputs = [{"prompt_token_ids": list(prompt)} for prompt in workload.prompts]
    mixes = {"plain": mix_fields("none", len(workload)), "mixed": mix_fields(args.mix, len(workload))}
    with make_llm(args, model_path, load_format, args.enforce_eager, tokenizer=True) as llm:
        warm = [our_params(fields, 16) for fields in mixes["mixed"][: max(1, args.warmup_requests)]]
        llm.generate(inputs[: len(warm)], warm, use_tqdm=False)
        for _ in range(max(1, args.runs)):
            for name, fields in mixes.items():
                params = [our_params(f, n) for f, n in zip(fields, workload.max_tokens, strict=True)]
                start = time.perf_counter()
                outputs = llm.generate(inputs, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                produced = sum(len(output.outputs[0].token_ids) for output in outputs)
                result[name].append({"output_tokens": produced, "seconds": seconds, "tokens_per_s": produced / seconds})
                log.info("mix run", engine="ours", workload=name, tok_s=round(produced / seconds, 1))
    return _summary(result)


def _summary(result: dict[str, Any]) -> dict[str, Any]:
    for name in ("plain", "mixed"):
        if result.get(name):
            result[f"{name}_tokens_per_s"] = max(run["tokens_per_s"] for run in result[name])
    if result.get("plain_tokens_per_s") and result.get("mixed_tokens_per_s"):
        result["cost"] = 1.0 - result["mixed_tokens_per_s"] / result["plain_tokens_per_s"]
    return result


def run(args: argparse.Namespace, workload: Workload, load_format: str, scratch_dir: Path,
        run_vllm_peer: Any) -> dict[str, Any]:
    """Ours, then (``--peer vllm``) vLLM's, both plain and mixed; ``mix.json`` written after each."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_path = args.model or str(write_model_dir_with_tokenizer(scratch_dir / "qwen3-0.6b-shape-tok"))
    report: dict[str, Any] = {"mix": args.mix, "json_share": 1 / JSON_EVERY, "schema": MIX_SCHEMA,
                              "penalties": PENALTIES, "num_requests": len(workload),
                              "output_tokens": workload.output_tokens}
    try:
        report["ours"] = run_ours(args, model_path, load_format, workload)
    except Exception as exc:  # recorded; the peer still runs
        log.exception("our mix run failed")
        report["ours"] = {"error": f"{type(exc).__name__}: {exc}"}
    (out / "mix.json").write_text(json.dumps(report, indent=2) + "\n")
    if "vllm" in args.peer:
        report["vllm"] = run_vllm_peer(args, model_path, load_format, workload, scratch_dir,
                                       int(QWEN3_0_6B_CONFIG["vocab_size"]), mix=args.mix)
        (out / "mix.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def format_mix(report: dict[str, Any]) -> str:
    lines = [f"mix {report['mix']}: {report['json_share']:.0%} JSON schema, the rest penalties; "
             f"{report['num_requests']} requests, {report['output_tokens']:,} output tokens",
             "engine   plain tok/s   mixed tok/s   cost"]
    for engine in ("ours", "vllm"):
        entry = report.get(engine)
        if not entry:
            continue
        if "error" in entry and not entry.get("mixed_tokens_per_s"):
            lines.append(f"{engine:<8} error: {entry['error'][:200]}")
            continue
        plain, mixed = entry.get("plain_tokens_per_s", 0.0), entry.get("mixed_tokens_per_s", 0.0)
        cost = f"{entry['cost']:.1%}" if "cost" in entry else "-"
        lines.append(f"{engine:<8} {plain:>11,.0f}   {mixed:>11,.0f}   {cost}")
    return "\n".join(lines)
