"""``vllm-actors bench throughput``: offline throughput of our engine on nano-vllm's workload.

The workload (nano-vllm's bench): 256 requests drawn after ``random.seed(0)`` - first every
prompt, ``randint(100, 1024)`` tokens of ``randint(0, 10000)``, then every ``max_tokens``,
``randint(100, 1024)`` - sampled at temperature 0.6 with EOS ignored: 133,966 output tokens. The
model has Qwen3-0.6B's shape with random weights (``load_format="dummy"``) unless ``--model``
names a checkpoint. Throughput = output tokens / wall time of ``llm.generate`` through the
process group, after a warm-up.

In order: the timed run, then the metrics store's event log (GPU idle share between decode steps,
step times, TTFT / ITL) and batch-1 decode on the same engine; batch-1 decode on a second engine
with CUDA graphs the other way; the table on stdout, ``results.json`` (rewritten after every part,
so a run cut short keeps what it measured) and ``throughput.png`` under ``--out``.

An ``Extension`` adds parts around these (``benchmarks/throughput.py``: the GPU's floor, the
transformers and vLLM peers, ``--mix``).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.bench.engine_env import engine_env_arg, engine_environment
from vllm_actors.bench.event_log import decode_idle_share, request_latencies, step_series, worker_steps
from vllm_actors.bench.report import BenchReport, format_table, write_json, write_png
from vllm_actors.bench.throughput_args import moe_config_arg, router_skew_arg, stages_arg
from vllm_actors.bench.throughput_engine import EngineSession, make_llm, measure_ours
from vllm_actors.bench.throughput_workload import (
    DEFAULT_NUM_REQUESTS,
    DEFAULT_SEED,
    EXPECTED_OUTPUT_TOKENS,
    MODEL_SHAPES,
    OUTPUT_LEN_RANGE,
    PROMPT_LEN_RANGE,
    QWEN3_0_6B_CONFIG,
    SHARED_PREFIX_DEFAULTS,
    TEMPERATURE,
    TOKEN_ID_RANGE,
    Workload,
    make_shared_prefix_workload,
    make_workload,
    write_model_dir,
)
from vllm_actors.envs import envs
from vllm_actors.models.router_skew import describe, parse_skew
from vllm_actors.observe import trace_file
from vllm_actors.protocol.events import DISABLE_EVENTS_ENV

# The workload and the event-log analysis live in their own modules; their names stay importable from here.
__all__ = [
    "EXPECTED_OUTPUT_TOKENS", "QWEN3_0_6B_CONFIG", "Extension", "Setup", "Workload", "add_model_arguments",
    "build_parser", "decode_idle_share", "main", "make_workload", "part", "request_latencies", "run", "step_series",
    "worker_steps", "write_model_dir",
]

log = structlog.get_logger(__name__)

ROUTER_SKEW_ENV = "VLLM_ACTORS_MOE_ROUTER_SKEW"
MOE_CONFIG_ENV = "VLLM_ACTORS_MOE_CONFIG"


# --------------------------------------------------------------------------- arguments
def add_model_arguments(parser: argparse.ArgumentParser) -> Any:
    """The benchmarks' "model and engine" group with its first options (--model, --load-format,
    --dtype); returns the group for the benchmark's own."""
    model = parser.add_argument_group("model and engine")
    model.add_argument("--model", default=None,
                       help="a checkpoint (HF directory or .gguf); default: Qwen3-0.6B's shape, random weights")
    model.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                       help="default: dummy without --model, auto with it")
    model.add_argument("--dtype", default="bfloat16")
    return model


def build_parser(prog: str = "vllm-actors bench throughput") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Offline throughput on nano-vllm's workload (the GPU's floor, the transformers and vLLM "
                    "peers and --mix: benchmarks/throughput.py).",
    )
    model = add_model_arguments(parser)
    model.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b",
                       help="without --model: the random checkpoint's shape")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="GPUs (ranks) of each pipeline stage")
    model.add_argument("--pipeline-parallel-size", "-pp", type=stages_arg, default=1,
                       help="pipeline stages of the engine (ours and the vLLM / SGLang peers), each of "
                            "--tensor-parallel-size GPUs: PP x TP GPUs in all")
    model.add_argument("--max-model-len", type=int, default=4096)
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in the timed run")
    model.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn prefix caching off (the workload's random prompts share nothing)")
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    model.add_argument("--block-size", type=int, default=None,
                       help="KV block (page) size; default: the engine's (ours only)")
    model.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens a step; default: the engine's LLM class's (ours only)")
    model.add_argument("--seed", type=int, default=DEFAULT_SEED, help="workload and engine seed")
    model.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="replicas (one GPU each) under one controller")
    model.add_argument("--routing-policy", default="round_robin",
                       choices=("round_robin", "least_loaded", "pull", "cache_aware"))
    model.add_argument("--moe-router-skew", type=router_skew_arg, default=None, metavar="zipf:S",
                       help="mixture-of-experts models: experts chosen Zipf-distributed (expert e with weight "
                            "(e+1)^-S) instead of as the random router says, in every engine alike "
                            "(VLLM_ACTORS_MOE_ROUTER_SKEW; models/router_skew.py)")
    model.add_argument("--moe-config", type=moe_config_arg, default=None, metavar="PATH",
                       help="our engine's fused-MoE tiles from this table (VLLM_ACTORS_MOE_CONFIG; "
                            "benchmarks/moe_sweep.py --table-out writes one)")
    model.add_argument("--engine-env", type=engine_env_arg, action="append", default=[], metavar="NAME=VALUE",
                       help="a VLLM_ACTORS_* setting for our engine's processes during our run only (repeatable; "
                            "an A/B of one switch, or VLLM_ACTORS_FP8_GEMM_CONFIG=a table a sweep wrote)")

    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=("nano-vllm", "shared-prefix"), default="nano-vllm",
                          help="shared-prefix: --prefix-groups groups of --prompts-per-group prompts, each a "
                               "shared --prefix-len-token system prompt plus a --question-len-token question, "
                               "--prefix-output-len tokens out (SGLang's generated-shared-prefix benchmark)")
    for name, default in SHARED_PREFIX_DEFAULTS.items():
        flag = {"groups": "prefix-groups", "per_group": "prompts-per-group", "prefix_len": "prefix-len",
                "question_len": "question-len", "output_len": "prefix-output-len"}[name]
        workload.add_argument(f"--{flag}", dest=f"shared_{name}", type=int, default=default,
                              help=f"shared-prefix workload (default {default})")
    workload.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
                          help="the first N requests of the workload")
    workload.add_argument("--max-input-len", type=int, default=PROMPT_LEN_RANGE[1], help="cut prompts to this")
    workload.add_argument("--max-output-len", type=int, default=OUTPUT_LEN_RANGE[1], help="cap max_tokens")
    workload.add_argument("--warmup-requests", type=int, default=4,
                          help="short requests (64-token prompts, 16 tokens) before the timed run")
    workload.add_argument("--runs", type=int, default=1,
                          help="timed runs of the workload per engine; the best counts (the event-log metrics "
                               "are the last run's)")
    workload.add_argument("--no-events", action="store_true",
                          help="engine actors publish no work events (VLLM_ACTORS_DISABLE_EVENTS=1): measures "
                               "what events cost; no event-log metrics and no batch-1 timeline")

    batch1 = parser.add_argument_group("batch-1 decode")
    batch1.add_argument("--no-batch1", action="store_true")
    batch1.add_argument("--batch1-input-len", type=int, default=1024)
    batch1.add_argument("--batch1-output-len", type=int, default=256)
    batch1.add_argument("--batch1-same-engine-only", action="store_true",
                        help="skip the second engine (CUDA graphs the other way)")

    output = parser.add_argument_group("output")
    output.add_argument("--out", default="results/throughput", help="directory for results.json, throughput.png")
    output.add_argument("--keep-events", action="store_true", help="also keep the event log as events.jsonl.gz")
    trace_file.add_trace_arguments(output, "the timed run's event log (as the metrics store retained it)")
    output.add_argument("--log-level",
                        default=envs.VLLM_ACTORS_LOG_LEVEL if envs.is_set("VLLM_ACTORS_LOG_LEVEL") else "INFO")
    return parser


def describe_router_skew(args: argparse.Namespace, model_path: str) -> dict[str, Any] | None:
    """The results' record of ``--moe-router-skew`` (the loads it gives); a ValueError for a dense model."""
    if args.moe_router_skew is None:
        return None
    from vllm_actors.models.config import ModelConfig

    config = ModelConfig.from_path(model_path)
    if config.num_experts < 1:
        raise ValueError(f"--moe-router-skew needs a mixture-of-experts model; {model_path} "
                         f"({config.architecture}) has no experts")
    return describe(parse_skew(args.moe_router_skew), config.num_experts, config.num_experts_per_tok)


def is_default_workload(args: argparse.Namespace) -> bool:
    return (args.num_requests == DEFAULT_NUM_REQUESTS and args.seed == DEFAULT_SEED
            and args.max_input_len >= PROMPT_LEN_RANGE[1] and args.max_output_len >= OUTPUT_LEN_RANGE[1])


# --------------------------------------------------------------------------- parts
@dataclass(frozen=True)
class Setup:
    """What every part of a run shares."""

    model_path: str
    load_format: str
    vocab_size: int
    workload: Workload
    scratch_dir: Path
    out_json: Path


class Extension:
    """Parts a developer benchmark adds around our engine's run; this base adds none."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """Options of the added parts."""

    def make_report(self, config: dict[str, Any]) -> BenchReport:
        return BenchReport(config=config)

    def instead(self, args: argparse.Namespace, setup: Setup, report: BenchReport) -> int | None:
        """An exit status to end the run with before our timed run, or None to go on."""
        return None

    def with_engine(self, args: argparse.Namespace, setup: Setup, session: EngineSession,
                    report: BenchReport) -> None:
        """After batch-1 decode, while the timed run's engine is still up."""

    def after_ours(self, args: argparse.Namespace, setup: Setup, report: BenchReport, ok: bool) -> None:
        """Once our engines are shut down; ``ok``: our timed run succeeded."""


def _config_record(args: argparse.Namespace, load_format: str, workload: Workload) -> dict[str, Any]:
    record: dict[str, Any] = dict(vars(args))
    record["load_format"] = load_format
    parallel = f"TP={args.tensor_parallel_size}, PP={getattr(args, 'pipeline_parallel_size', 1)}"
    record["model_description"] = (
        f"{args.model_shape} shape, random weights (load_format=dummy), {parallel}"
        if args.model is None
        else f"{args.model} (load_format={load_format}), {parallel}"
    )
    record["workload"] = {"name": args.workload, "num_requests": len(workload), "prompt_tokens": workload.prompt_tokens,
                          "output_tokens": workload.output_tokens, "temperature": TEMPERATURE, "ignore_eos": True}
    record["python"] = sys.version.split()[0]
    try:
        import torch

        record["torch"] = torch.__version__
    except ImportError:
        pass
    return record


def _batch1_key(enforce_eager: bool) -> str:
    return "graphs_off" if enforce_eager else "graphs_on"


@contextmanager
def part(report: BenchReport, name: str, out_json: Path) -> Iterator[None]:
    """Runs one optional part: its failure is recorded in the report instead of ending the run;
    the results so far are written either way."""
    try:
        yield
    except Exception as exc:
        log.exception("benchmark part failed", part=name)
        report.errors[name] = f"{type(exc).__name__}: {exc}"
    finally:
        write_json(report, out_json)


# --------------------------------------------------------------------------- main
def _run_ours(args: argparse.Namespace, setup: Setup, report: BenchReport, extension: Extension) -> bool:
    """The timed run, its metrics and batch-1 on the same engine. False if the run failed."""
    out_json = setup.out_json
    try:
        started = time.perf_counter()
        with make_llm(args, setup.model_path, setup.load_format, args.enforce_eager) as llm:
            report.startup_s = time.perf_counter() - started
            session = EngineSession(llm)
            steps, start_wall = measure_ours(args, session, setup.workload, report, setup.scratch_dir)
            report.steps = step_series(steps, start_wall)
            write_json(report, out_json)
            if not args.no_batch1 and not args.no_events:
                key = _batch1_key(args.enforce_eager)
                with part(report, f"batch1_{key}", out_json):
                    report.batch1[key] = session.batch1(args, args.enforce_eager, setup.vocab_size)
            extension.with_engine(args, setup, session, report)
    except Exception as exc:
        log.exception("the timed run failed")
        report.errors["ours"] = f"{type(exc).__name__}: {exc}"
        write_json(report, out_json)
        return False
    finally:
        events = setup.scratch_dir / "events.jsonl"
        if args.keep_events and events.is_file():
            with events.open("rb") as source, gzip.open(Path(args.out) / "events.jsonl.gz", "wb") as target:
                shutil.copyfileobj(source, target)
        if args.trace and events.is_file():
            with part(report, "trace", out_json):
                bound = trace_file.max_trace_bytes(args.trace_max_mb)
                written = trace_file.write_trace(trace_file.read_dump(events), args.trace, bound)
                report.config["trace"] = trace_file.trace_record(written)
    return True


def _run_other_batch1(args: argparse.Namespace, setup: Setup, report: BenchReport) -> None:
    """Batch-1 on a second engine with CUDA graphs the other way (the first is shut down)."""
    other = not args.enforce_eager
    key = _batch1_key(other)
    with part(report, f"batch1_{key}", setup.out_json), \
            make_llm(args, setup.model_path, setup.load_format, other) as llm:
        session = EngineSession(llm)
        session.warm_up(setup.workload, max(1, args.warmup_requests))
        report.batch1[key] = session.batch1(args, other, setup.vocab_size)


def _vocab_size(model_path: str) -> int:
    from vllm_actors.models.config import ModelConfig

    return int(ModelConfig.from_path(model_path).vocab_size)


def _make_workload(args: argparse.Namespace) -> Workload:
    if args.workload == "shared-prefix":
        return make_shared_prefix_workload(**{name: getattr(args, f"shared_{name}") for name in SHARED_PREFIX_DEFAULTS},
                                           seed=args.seed)
    return make_workload(args.num_requests, args.max_input_len, args.max_output_len, args.seed)


def run(args: argparse.Namespace, extension: Extension | None = None) -> tuple[BenchReport, int]:
    """Every part in order; returns the report and the exit status (1 if our timed run failed)."""
    extension = extension or Extension()
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    workload = _make_workload(args)
    if args.workload == "nano-vllm" and is_default_workload(args) and workload.output_tokens != EXPECTED_OUTPUT_TOKENS:
        raise AssertionError(f"the default workload has {workload.output_tokens} output tokens, "
                             f"expected {EXPECTED_OUTPUT_TOKENS}")
    load_format = args.load_format or ("dummy" if args.model is None else "auto")

    with tempfile.TemporaryDirectory(prefix="vllm-actors-bench-") as scratch:
        scratch_dir = Path(scratch)
        model_path = args.model or str(write_model_dir(scratch_dir / f"{args.model_shape}-shape",
                                                       MODEL_SHAPES[args.model_shape]))
        vocab_size = _vocab_size(model_path)
        if vocab_size <= TOKEN_ID_RANGE[1]:
            log.warning("the model's vocabulary is smaller than the workload's token ids: folding them",
                        vocab_size=vocab_size)
            workload = workload.fit_vocab(vocab_size)
        setup = Setup(model_path, load_format, vocab_size, workload, scratch_dir, out_dir / "results.json")
        report = extension.make_report(_config_record(args, load_format, workload))
        report.config["router_skew"] = describe_router_skew(args, model_path)
        status = extension.instead(args, setup, report)
        if status is not None:
            return report, status

        if args.no_events:
            os.environ[DISABLE_EVENTS_ENV] = "1"  # read by every actor of the group at its start
        if args.trace:  # the whole run in the store's log, read by the metrics store at its start
            os.environ.update(trace_file.retention_env(args.trace_max_events))
        engine_env: dict[str, str] = {}
        if args.moe_router_skew is not None:  # read by every worker's MoE layers as they are built
            engine_env[ROUTER_SKEW_ENV] = args.moe_router_skew
        if args.moe_config is not None:  # read by every worker's MoE layers as they choose their tiles
            engine_env[MOE_CONFIG_ENV] = args.moe_config
        engine_env.update(args.engine_env)
        with engine_environment(engine_env):
            ok = _run_ours(args, setup, report, extension)
            for name in (DISABLE_EVENTS_ENV, *trace_file.retention_env(0)):
                os.environ.pop(name, None)
            if ok and not args.no_batch1 and not args.batch1_same_engine_only and not args.no_events:
                _run_other_batch1(args, setup, report)
        extension.after_ours(args, setup, report, ok)

    report.total_seconds = time.perf_counter() - started
    with part(report, "plot", setup.out_json):
        if write_png(report, out_dir / "throughput.png"):
            log.info("plot written", path=str(out_dir / "throughput.png"))
    return report, 0 if ok else 1


def main(argv: list[str] | None = None, extension: Extension | None = None,
         prog: str = "vllm-actors bench throughput") -> int:
    extension = extension or Extension()
    parser = build_parser(prog)
    extension.add_arguments(parser)
    args = parser.parse_args(argv)
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging(args.log_level)
    report, status = run(args, extension)
    print(format_table(report))
    print(f"\nresults: {Path(args.out) / 'results.json'}")
    return status
