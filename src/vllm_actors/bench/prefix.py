"""``vllm-actors bench prefix``: what prefix caching buys, caching on against caching off.

Two workloads of random token ids (drawn from seeded generators, so no tokenizer is involved),
sampled greedily with EOS ignored, so every request produces exactly ``--max-tokens`` tokens:

- ``shared``: 256 requests sharing one 2,000-token system prompt, each followed by 20-100 tokens of
  its own, all submitted at once;
- ``chat``: 64 conversations of 4 turns, 16 of them active at a time (the next one starts when one
  ends). Each turn sends the whole history (the previous turn's prompt and the tokens its reply
  generated) plus 50-150 new user tokens, as soon as the previous reply has ended.

The model has Qwen3-0.6B's shape with random weights (``load_format="dummy"``) unless ``--model``
names a checkpoint. Each workload runs twice, each time on a fresh process group driven through
``AsyncEngineClient``: prefix caching on, then off. Each run starts with a warm-up of unrelated
tokens (requests one after the other, each extending the previous one's prompt so that the path
reusing cached blocks runs too, then a burst of concurrent ones so that batched shapes have run),
then the timed part. The workloads themselves live in ``vllm_actors.bench.prefix_workloads``.
Measured on the client, per request: TTFT (submit to first token) and end-to-end time; per run:
wall time, output and total (prompt + output) tokens/s, TTFT mean / p50 / p99, and the prefix-cache
hit rate, prefix_cache_hits / prefix_cache_queries from the metrics store (the counters after the
timed part minus before it; null when the store does not report them).

Under ``--out``: ``results.json`` (rewritten after every run, so a run cut short keeps what it
measured) and ``prefix.png`` (TTFT CDF and throughput, on vs off, per workload; skipped without
matplotlib); the table goes to stdout.

This module holds the arguments and the order of the runs; one run is in ``prefix_run``, the
report in ``prefix_report``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.bench.prefix_report import PrefixReport, caching_key, format_report, write_png
from vllm_actors.bench.prefix_run import (
    DEFAULT_WARMUP_REQUESTS,
    EngineOptions,
    RunResult,
    StoreCounters,
    check_fits,
    measure_run,
)
from vllm_actors.bench.prefix_workloads import (
    DEFAULT_CONCURRENCY,
    DEFAULT_CONVERSATIONS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_NUM_REQUESTS,
    DEFAULT_SEED,
    DEFAULT_SYSTEM_TOKENS,
    DEFAULT_TURNS,
    WORKLOAD_NAMES,
    Workload,
    make_chat_workload,
    make_shared_workload,
)
from vllm_actors.bench.report import write_json
from vllm_actors.bench.throughput import add_model_arguments
from vllm_actors.bench.throughput_workload import write_model_dir
from vllm_actors.envs import envs

# One run and the report live in their own modules; their names stay importable from here.
__all__ = [
    "PrefixReport", "RunResult", "StoreCounters", "build_parser", "format_report", "main", "parse_workloads", "run",
]

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- arguments
def parse_workloads(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in WORKLOAD_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"workloads are a comma-separated subset of {','.join(WORKLOAD_NAMES)}, "
                                         f"got {text!r}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-actors bench prefix",
        description="Prefix caching on vs off: a shared system prompt and multi-turn chat.",
    )
    model = add_model_arguments(parser)
    model.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    model.add_argument("--max-model-len", type=int, default=4096, help="capped at the model's own maximum")
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--max-num-batched-tokens", type=int, default=None)
    model.add_argument("--num-gpu-blocks-override", type=int, default=None)
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    model.add_argument("--block-size", type=int, default=None)
    model.add_argument("--cpu-kv-cache-gib", type=float, default=None)
    model.add_argument("--scheduling-policy", default=None, help="passed to the engine when given (fcfs, lpm)")
    model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    model.add_argument("--seed", type=int, default=DEFAULT_SEED, help="workload and engine seed")

    workload = parser.add_argument_group("workloads")
    workload.add_argument("--workloads", type=parse_workloads, default=WORKLOAD_NAMES,
                          help="comma-separated, run in this order (default: shared,chat)")
    workload.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="output tokens per request")
    workload.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS, help="shared: requests")
    workload.add_argument("--system-tokens", type=int, default=DEFAULT_SYSTEM_TOKENS,
                          help="shared: tokens of the common system prompt")
    workload.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS, help="chat: conversations")
    workload.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                          help="chat: conversations active at a time")
    workload.add_argument("--turns", type=int, default=DEFAULT_TURNS, help="chat: turns per conversation")
    workload.add_argument("--off-first", action="store_true",
                          help="run caching off before caching on (to see whether the order matters)")
    workload.add_argument("--warmup-requests", type=int, default=DEFAULT_WARMUP_REQUESTS,
                          help="unrelated requests before each timed run, each extending the previous "
                               "prompt (from 2 on, the path reusing cached blocks is warm too)")

    output = parser.add_argument_group("output")
    output.add_argument("--out", default="results/prefix", help="directory for results.json and prefix.png")
    output.add_argument("--log-level",
                        default=envs.VLLM_ACTORS_LOG_LEVEL if envs.is_set("VLLM_ACTORS_LOG_LEVEL") else "INFO")
    return parser


PASS_THROUGH = ("max_num_batched_tokens", "num_gpu_blocks_override", "block_size", "cpu_kv_cache_gib",
                "scheduling_policy")  # given to the engine only when set


def engine_options(args: argparse.Namespace, model_path: str, load_format: str, max_model_len: int) -> EngineOptions:
    engine_args: dict[str, Any] = {
        "skip_tokenizer_init": True, "dtype": args.dtype, "device": args.device, "max_model_len": max_model_len,
        "max_num_seqs": args.max_num_seqs, "gpu_memory_utilization": args.gpu_memory_utilization,
        "seed": args.seed, "enforce_eager": args.enforce_eager,
    }
    engine_args.update({name: getattr(args, name) for name in PASS_THROUGH if getattr(args, name) is not None})
    if load_format != "auto":
        engine_args["load_format"] = load_format
    check = envs.VLLM_ACTORS_CHECK_INVARIANTS
    return EngineOptions(model=model_path, engine_args=engine_args, check_invariants=check)


def make_workloads(args: argparse.Namespace, vocab_size: int) -> list[Workload]:
    workloads: list[Workload] = []
    for name in args.workloads:
        if name == "shared":
            workloads.append(make_shared_workload(args.num_requests, args.system_tokens, args.max_tokens,
                                                  vocab_size, args.seed))
        else:
            workloads.append(make_chat_workload(args.conversations, args.turns, args.concurrency, args.max_tokens,
                                                vocab_size, args.seed))
    return workloads


def _config_record(args: argparse.Namespace, load_format: str, max_model_len: int,
                   workloads: Sequence[Workload]) -> dict[str, Any]:
    record: dict[str, Any] = {key: value for key, value in vars(args).items() if key != "workloads"}
    record["workloads"] = {workload.name: workload.describe() for workload in workloads}
    record["load_format"] = load_format
    record["resolved_max_model_len"] = max_model_len
    record["sampling"] = {"temperature": 0.0, "ignore_eos": True}
    record["model_description"] = (
        "Qwen3-0.6B shape, random weights (load_format=dummy)" if args.model is None
        else f"{args.model} (load_format={load_format})"
    )
    record["python"] = sys.version.split()[0]
    try:
        import torch

        record["torch"] = torch.__version__
        record["cuda_device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return record


# --------------------------------------------------------------------------- main
async def run_all(args: argparse.Namespace, options: EngineOptions, workloads: Sequence[Workload],
                  report: PrefixReport, out_json: Path) -> bool:
    """Every workload with caching on and off (``--off-first``: off, then on); a failed run is
    recorded and the others go on. False when any run failed."""
    ok = True
    order = (False, True) if args.off_first else (True, False)
    for workload in workloads:
        for prefix_caching in order:
            try:
                report.add(await measure_run(options, workload, prefix_caching, args.warmup_requests, args.seed))
            except Exception as exc:
                log.exception("benchmark run failed", workload=workload.name, enable_prefix_caching=prefix_caching)
                report.errors[f"{workload.name}/{caching_key(prefix_caching)}"] = f"{type(exc).__name__}: {exc}"
                ok = False
            write_json(report, out_json)
    return ok


def run(args: argparse.Namespace) -> tuple[PrefixReport, int]:
    """Every run, then the JSON and the plot; returns the report and the exit status (1: a run failed)."""
    from vllm_actors.models.config import ModelConfig

    started = time.perf_counter()
    out_dir = Path(args.out)
    out_json = out_dir / "results.json"
    load_format = args.load_format or ("dummy" if args.model is None else "auto")
    with tempfile.TemporaryDirectory(prefix="vllm-actors-bench-prefix-") as scratch:
        model_path = args.model or str(write_model_dir(Path(scratch) / "qwen3-0.6b-shape"))
        model_config = ModelConfig.from_path(model_path)
        max_model_len = min(args.max_model_len, model_config.derived_max_model_len)
        workloads = make_workloads(args, model_config.vocab_size)
        for workload in workloads:
            check_fits(workload, max_model_len)
        out_dir.mkdir(parents=True, exist_ok=True)
        report = PrefixReport(config=_config_record(args, load_format, max_model_len, workloads))
        options = engine_options(args, model_path, load_format, max_model_len)
        ok = asyncio.run(run_all(args, options, workloads, report, out_json))
    report.total_seconds = time.perf_counter() - started
    write_json(report, out_json)
    if write_png(report, out_dir / "prefix.png"):
        log.info("plot written", path=str(out_dir / "prefix.png"))
    return report, 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging(args.log_level)
    try:
        report, status = run(args)
    except ValueError as exc:  # a workload that cannot run with these arguments
        parser.error(str(exc))
    print(format_report(report))
    print(f"\nresults: {Path(args.out) / 'results.json'}")
    return status
