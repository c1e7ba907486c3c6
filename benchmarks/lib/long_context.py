"""``benchmarks/long_context.py``: time to first token and decode at long contexts, our engine against
vLLM and SGLang, one request at a time, against the decode floor of the measured copy bandwidth.

Each engine of ``--engines`` runs in a process of its own, one after the other, the GPU left to
each alone: ours as ``python -m benchmarks.lib.long_context_ours``, vLLM and SGLang as
peer_long.py copied to a scratch folder and run with the peer's Python and PYTHONPATH. Every one
is measured by the same loop (long_context_run.run_engine, whose docstring says how: fresh random prompts,
TTFT and decode by the client's clock from each token's arrival).

Each engine starts once per run, with ``max_model_len`` = the largest of ``--contexts`` (how a
long-context server is configured: one engine for every request up to its window), and takes the
contexts in increasing order; its startup time and resolved settings go into the report. The
same arguments go to every engine: dtype, ``--tensor-parallel-size``, ``--pipeline-parallel-size`` and
``--max-num-batched-tokens`` (SGLang's pp_size and chunked_prefill_size), ``--kv-cache-dtype`` (ours
gets it only when it is not "auto"), prefix caching on, ``--gpu-memory-utilization`` (vLLM's and
ours; SGLang keeps its own ``mem_fraction_static`` unless ``--sglang-mem-fraction-static``); every
other setting is each engine's default. A run too long for one call (1M-token prefills take minutes
each) is split over calls with ``--append``: each call adds its engines' contexts to the same
report, and the table is rebuilt from all of them.

The floor of a context is the time to read, per decode step and per GPU, the weights once and the
KV of the context at mid-decode (prompt + output/2 tokens), at the device-to-device copy bandwidth
(floor.measure_copy_bandwidth, measured in a process of its own before the engines, or
``--bandwidth``). Writes ``long_context.json`` and ``long_context.md`` under ``--out``; with
``--trace``, each context's first measured prefill of ours as ``trace-ours-<context>.json.gz``
beside them and as its table of chunks per stage in both (long_context_chunks.py).

``--prefill-probe-tokens P`` measures the longest contexts without running their prefill to the end
(long_context_run.probe_context): each engine, started for the context, is offered its whole prompt for
``--admit-seconds`` (the report says whether it was admitted), then times prompts of P tokens, the
first chunks of that prefill: the prefill rate P / TTFT, and decode at P tokens of context.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib import long_context_run
from benchmarks.lib.floor import ModelShape
from benchmarks.lib.long_context_model import context_label, model_setup, parse_context, samples_plan
from benchmarks.lib.long_context_process import engine_command, measure_bandwidth, run_process
from benchmarks.lib.long_context_report import (
    ENGINE_ORDER,
    add_engine_result,
    build_rows,
    format_markdown,
    load_report,
    new_report,
    write_report,
)
from vllm_actors.bench.throughput_workload import MODEL_SHAPES

# settings that must match for --append to add to an earlier report
SAME_SETTINGS = ("model", "model_shape", "load_format", "rope_scaling", "dtype", "tensor_parallel_size",
                 "pipeline_parallel_size", "kv_parallel_size", "max_num_batched_tokens", "kv_cache_dtype",
                 "output_len", "block_size", "prefill_probe_tokens", "batch")
# for reports written before the setting
SETTING_DEFAULTS = {"kv_parallel_size": 1, "block_size": None, "prefill_probe_tokens": None, "batch": 1}


def _context(text: str) -> int:
    try:
        return parse_context(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/long_context.py", description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model and engines")
    model.add_argument("--model", default=None,
                       help="a Hugging Face directory (default: --model-shape, random weights)")
    model.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama-3.2-1b")
    model.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                       help="default: dummy without --model, auto with it")
    model.add_argument("--dtype", default="bfloat16")
    model.add_argument("--rope-scaling", type=_json_object, default=None,
                       help="JSON for config.json's rope_scaling, e.g. Qwen3's yarn "
                            "'{\"rope_type\": \"yarn\", \"factor\": 4.0, \"original_max_position_embeddings\": 32768}'")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    model.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="pipeline stages (ours and vLLM): a prompt's chunks flow through them back to back")
    model.add_argument("--kv-parallel-size", type=int, default=1,
                       help="KV-parallel ranks (ours only: vLLM and SGLang have none): each request's KV "
                            "interleaved over them, attention merged by log-sum-exp; KVP x TP GPUs")
    model.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="the prefill chunk (ours and vLLM; default: each engine's): C chunks of a prompt over "
                            "P stages take (C+P-1)/(C*P) of one stage's time at best")
    model.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto")
    model.add_argument("--block-size", type=int, default=None,
                       help="KV block (page) size of every engine; default: each engine's (ours: 128 on Hopper "
                            "with flash-attn 4, else 16; vLLM: 16)")
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="ours and vLLM")
    model.add_argument("--sglang-mem-fraction-static", type=float, default=None, help="default: SGLang's")
    model.add_argument("--engines", nargs="+", choices=ENGINE_ORDER, default=["ours", "vllm"],
                       help="run one after the other, each in its own process")
    for peer, site in (("vllm", "/tmp/vsite"), ("sglang", "/tmp/ssite")):
        model.add_argument(f"--{peer}-python", default=sys.executable, help=f"the Python that runs {peer}")
        model.add_argument(f"--{peer}-pythonpath", default=site,
                           help=f"PYTHONPATH of {peer}'s process (where its packages are; '' to inherit ours)")

    load = parser.add_argument_group("requests")
    load.add_argument("--contexts", type=_context, nargs="+", default=[16384, 32768, 65536, 131072],
                      help="tokens per request (prompt + output): N, Nk = N x 1,024, NM = N x 1,000,000; "
                           "e.g. 16k 32k 64k 128k 1M")
    load.add_argument("--output-len", type=int, default=128, help="tokens decoded per request")
    load.add_argument("--repeats", type=int, default=None,
                      help="samples per context (default 3, 1 from 512k tokens on)")
    load.add_argument("--no-context-warmup", dest="context_warmup", action="store_false",
                      help="no discarded request at each context first (there is none from 512k on anyway)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--prefill-probe-tokens", type=int, default=None,
                      help="do not run a context's prompt to its end: offer the whole prompt for --admit-seconds "
                           "(admitted or refused), then time prompts of this many tokens (the first chunks of its "
                           "prefill: TTFT gives the prefill rate; decode is measured at that length)")
    load.add_argument("--admit-seconds", type=float, default=10.0,
                      help="with --prefill-probe-tokens: how long the whole prompt runs before it is aborted")
    load.add_argument("--batch", type=int, default=1,
                      help="prompts of each context submitted at once: TTFT their median, decode ms a step of all "
                           "of them (the floor reads their KV; e.g. 32 sequences of 16k where KV dominates)")

    output = parser.add_argument_group("floor and output")
    output.add_argument("--bandwidth", type=float, default=None, help="bytes/s instead of the measured copy bandwidth")
    output.add_argument("--no-floor", action="store_true", help="do not measure the copy bandwidth")
    output.add_argument("--timeout", type=float, default=3600.0, help="seconds per engine process")
    output.add_argument("--trace", action="store_true",
                        help="ours only: each context's first measured prefill from the metrics store, as a Chrome "
                             "trace (trace-ours-<context>.json.gz under --out) and its table of chunks per stage "
                             "in the report")
    output.add_argument("--append", action="store_true", help="add to the report already under --out")
    output.add_argument("--out", default="results/long_context", help="directory for long_context.json and .md")
    return parser


def run_engine(args: argparse.Namespace, engine: str, model_path: str, vocab_size: int, scratch: Path,
               out_dir: Path, run_index: int) -> tuple[dict[str, Any], str, str | None]:
    """One engine's process; its result (what it wrote, even if it failed), its log's name, its error."""
    repeats, warmups = samples_plan(args.contexts, args.repeats, args.context_warmup)
    result_path = out_dir / f"{engine}-{run_index}.json"
    result_path.unlink(missing_ok=True)
    common = [
        "--model", model_path, "--out", str(result_path), "--contexts", *map(str, args.contexts),
        "--repeats", *map(str, repeats), "--warmup", *map(str, warmups), "--output-len", str(args.output_len),
        "--max-model-len", str(max(args.contexts)), "--load-format", args.load_format, "--dtype", args.dtype,
        "--tensor-parallel-size", str(args.tensor_parallel_size), "--kv-cache-dtype", args.kv_cache_dtype,
        "--pipeline-parallel-size", str(args.pipeline_parallel_size),
        *(["--kv-parallel-size", str(args.kv_parallel_size)] if args.kv_parallel_size > 1 else []),
        *(["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []),
        *(["--block-size", str(args.block_size)] if args.block_size else []),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed),
        "--vocab-size", str(vocab_size),
        *(["--prefill-probe-tokens", str(args.prefill_probe_tokens), "--admit-seconds", str(args.admit_seconds)]
          if args.prefill_probe_tokens else []),
        *(["--batch", str(args.batch)] if args.batch > 1 else []),
    ]
    if engine == "ours" and args.trace:
        common += ["--trace-dir", str(out_dir)]
    command, env = engine_command(args, engine, scratch, common)
    log_path = out_dir / f"{engine}-{run_index}.log"
    print(f"{engine}: {' '.join(command)}", flush=True)
    error = run_process(command, env, log_path, args.timeout)
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    return result, log_path.name, error


# --------------------------------------------------------------------------- main
def _config(args: argparse.Namespace, description: str, overrides: dict[str, Any]) -> dict[str, Any]:
    config = {key: value for key, value in vars(args).items() if not key.endswith(("_python", "_pythonpath"))}
    if args.model is not None:
        config["model_shape"] = None  # --model's config.json gives the shape
    config.update(model_description=description, model_overrides=overrides, max_model_len=max(args.contexts),
                  python=sys.version.split()[0])
    config.update({f"{peer}_python": getattr(args, f"{peer}_python") for peer in ("vllm", "sglang")})
    config.update({f"{peer}_pythonpath": getattr(args, f"{peer}_pythonpath") for peer in ("vllm", "sglang")})
    return config


def _start_report(args: argparse.Namespace, config: dict[str, Any], path: Path) -> dict[str, Any]:
    previous = load_report(path) if args.append else None
    if previous is None:
        return new_report(config)
    differ = [key for key in SAME_SETTINGS
              if previous["config"].get(key, SETTING_DEFAULTS.get(key)) != config.get(key)]
    if differ:
        raise ValueError(f"--append: {path} was measured with other settings ({', '.join(differ)}); "
                         "give another --out")
    previous["config"] = config
    return previous


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    args.contexts = sorted(set(args.contexts))
    if args.kv_parallel_size > 1 and set(args.engines) != {"ours"}:
        raise ValueError(f"--kv-parallel-size {args.kv_parallel_size} runs ours only (vLLM and SGLang have no KV "
                         "parallelism): give --engines ours, and their TP or context parallelism in another run")
    if args.batch > 1 and (args.trace or args.prefill_probe_tokens):
        raise ValueError("--batch times whole prompts submitted at once: not with --trace or --prefill-probe-tokens")
    if args.trace and "ours" not in args.engines:
        raise ValueError("--trace traces our engine's prefills: give --engines with ours")
    args.load_format = args.load_format or ("dummy" if args.model is None else "auto")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    status = 0
    with tempfile.TemporaryDirectory(prefix="long-context-") as scratch_name:
        scratch = Path(scratch_name)
        setup = model_setup(args.model, args.model_shape, scratch, max(args.contexts), args.rope_scaling)
        for context in args.contexts:
            long_context_run.prompt_len(context, args.output_len)  # a context too short for the output: say so now
        report = _start_report(args, _config(args, setup.description, setup.overrides), out_dir / "long_context.json")
        if args.bandwidth is not None:
            report["bandwidth"] = {"bytes_per_s": args.bandwidth, "source": "given"}
        elif report["bandwidth"] is None and not args.no_floor:
            report["bandwidth"] = measure_bandwidth(out_dir)
        dtype_bytes = 4 if args.dtype in ("float32", "float") else 2
        shape = ModelShape.from_hf_config(setup.config, dtype_bytes=dtype_bytes)
        bandwidth = report["bandwidth"]["bytes_per_s"] if report["bandwidth"] else None
        write_report(report, out_dir)
        for engine in args.engines:
            result, log, error = run_engine(args, engine, setup.path, int(setup.config["vocab_size"]), scratch,
                                            out_dir, len(report["runs"]))
            add_engine_result(report, engine, result, log, error, {"max_model_len": max(args.contexts),
                                                                    "model_description": setup.description})
            build_rows(report, shape, bandwidth, args.tensor_parallel_size, args.kv_cache_dtype, args.batch)
            write_report(report, out_dir)
            failed = error or result.get("error") or any("error" in c for c in result.get("contexts", {}).values())
            if failed:
                status = 1
                print(f"{engine} failed: {error or 'see its log'} ({out_dir / log})", flush=True)
    return report, status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.output_len < 2:
        raise SystemExit("--output-len must be at least 2 (decode is timed between the first and the last token)")
    try:
        report, status = run(args)
    except ValueError as error:
        raise SystemExit(f"benchmarks/long_context.py: {error}") from None
    print(format_markdown(report))
    print(f"results: {Path(args.out) / 'long_context.json'} and long_context.md; contexts "
          + ", ".join(context_label(c) for c in args.contexts))
    return status
