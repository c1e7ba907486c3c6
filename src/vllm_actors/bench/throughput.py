"""``vllm-actors bench throughput``: nano-vllm's throughput benchmark, with its floor, a peer, and
where the time goes.

The workload (nano-vllm's bench): 256 requests drawn after ``random.seed(0)`` - first every
prompt, ``randint(100, 1024)`` tokens of ``randint(0, 10000)``, then every ``max_tokens``,
``randint(100, 1024)`` - sampled at temperature 0.6 with EOS ignored: 133,966 output tokens. The
model has Qwen3-0.6B's shape with random weights (``load_format="dummy"``) unless ``--model``
names a checkpoint. Throughput = output tokens / wall time of ``llm.generate`` through the
process group, after a warm-up.

In the same run, in this order (the GPU is left to each part alone):

1. ours: the timed run, then the metrics store's event log (GPU idle share between decode steps,
   step times, TTFT / ITL) and batch-1 decode on the same engine;
2. batch-1 decode on a second engine with CUDA graphs the other way (``enforce_eager`` flipped);
3. the GPU's copy bandwidth and bf16 matmul rate, and the workload's floor from them (floor.py);
4. the transformers peer on the same requests (peer_transformers.py);
5. the table on stdout, ``results.json`` and ``throughput.png`` under ``--out``.

``results.json`` is rewritten after every part, so a run cut short keeps what it measured.

This module holds the arguments, the parts' order and the GPU-side parts; the workload is in
``throughput_workload``, our engine's part in ``throughput_engine``, the event log's analysis in
``event_log``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.bench import throughput_mix
from vllm_actors.bench.event_log import decode_idle_share, request_latencies, step_series, worker_steps
from vllm_actors.bench.floor import Floor, GpuCeilings, ModelShape, measure_ceilings, workload_floor
from vllm_actors.bench.report import BenchReport, format_table, write_json, write_png
from vllm_actors.bench.throughput_engine import EngineSession, make_llm, measure_ours
from vllm_actors.bench.throughput_workload import (
    DEFAULT_NUM_REQUESTS,
    DEFAULT_SEED,
    EXPECTED_OUTPUT_TOKENS,
    MODEL_SHAPES,
    OUTPUT_LEN_RANGE,
    PROMPT_LEN_RANGE,
    QWEN3_0_6B_CONFIG,
    TEMPERATURE,
    TOKEN_ID_RANGE,
    Workload,
    make_workload,
    write_model_dir,
)
from vllm_actors.observe import trace_file
from vllm_actors.protocol.events import DISABLE_EVENTS_ENV

# The workload and the event-log analysis live in their own modules; their names stay importable from here.
__all__ = [
    "EXPECTED_OUTPUT_TOKENS", "QWEN3_0_6B_CONFIG", "Workload", "add_model_arguments", "build_parser",
    "decode_idle_share", "main", "make_workload", "request_latencies", "run", "step_series", "worker_steps",
    "write_model_dir",
]

log = structlog.get_logger(__name__)


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-actors bench throughput",
        description="Offline throughput on nano-vllm's workload, against the GPU's floor and transformers.",
    )
    model = add_model_arguments(parser)
    model.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="qwen3-0.6b",
                       help="without --model: the random checkpoint's shape")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="GPUs (ranks) for our engine and the vLLM peer")
    model.add_argument("--max-model-len", type=int, default=4096)
    model.add_argument("--max-num-seqs", type=int, default=256)
    model.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs in the timed run")
    model.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn prefix caching off (the workload's random prompts share nothing)")
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    model.add_argument("--seed", type=int, default=DEFAULT_SEED, help="workload and engine seed")
    model.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="replicas (one GPU each) under one controller; the vLLM peer runs with one")
    model.add_argument("--routing-policy", default="round_robin",
                       choices=("round_robin", "least_loaded", "pull", "cache_aware"))

    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-requests", type=int, default=DEFAULT_NUM_REQUESTS,
                          help="the first N requests of the workload")
    workload.add_argument("--max-input-len", type=int, default=PROMPT_LEN_RANGE[1], help="cut prompts to this")
    workload.add_argument("--max-output-len", type=int, default=OUTPUT_LEN_RANGE[1], help="cap max_tokens")
    workload.add_argument("--warmup-requests", type=int, default=4,
                          help="short requests (64-token prompts, 16 tokens) before the timed run")
    workload.add_argument("--runs", type=int, default=1,
                          help="timed runs of the workload per engine; the best counts (the event-log metrics "
                               "are the last run's)")
    workload.add_argument("--mix", choices=throughput_mix.MIXES, default="none",
                          help="json-penalties: 10%% JSON schema, the rest penalties; json: the 10%% alone; "
                               "penalties: all; each against plain on one engine (throughput_mix.py)")
    workload.add_argument("--no-events", action="store_true",
                          help="engine actors publish no work events (VLLM_ACTORS_DISABLE_EVENTS=1): measures "
                               "what events cost; no event-log metrics, batch-1 by the client's clock only")

    floor = parser.add_argument_group("floor")
    floor.add_argument("--no-floor", action="store_true", help="do not measure the GPU's ceilings")
    floor.add_argument("--bandwidth", type=float, default=None,
                       help="bytes/s to compute the floor with instead of the measured copy bandwidth")
    floor.add_argument("--matmul-rate", type=float, default=None,
                       help="FLOP/s to compute the floor with instead of the measured bf16 matmul rate")

    peer = parser.add_argument_group("peer")
    peer.add_argument("--peer", choices=("transformers", "vllm", "none"), default="transformers",
                      help="vllm: vLLM's offline LLM on the same workload, in its own process (peer_vllm.py)")
    peer.add_argument("--no-peer", dest="peer", action="store_const", const="none", help="same as --peer none")
    peer.add_argument("--peer-num-requests", type=int, default=None,
                      help="run the peer on the first N requests only (default: --num-requests)")
    peer.add_argument("--peer-attn", default=None,
                      help="transformers attn_implementation (default: its paged sdpa)")
    peer.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds")
    peer.add_argument("--vllm-python", default=sys.executable, help="the Python that runs vLLM")
    peer.add_argument("--vllm-pythonpath", default="/tmp/vsite",
                      help="PYTHONPATH of vLLM's process (where its packages are; '' to inherit ours)")

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
    output.add_argument("--log-level", default=os.environ.get("VLLM_ACTORS_LOG_LEVEL", "INFO"))
    return parser


def is_default_workload(args: argparse.Namespace) -> bool:
    return (args.num_requests == DEFAULT_NUM_REQUESTS and args.seed == DEFAULT_SEED
            and args.max_input_len >= PROMPT_LEN_RANGE[1] and args.max_output_len >= OUTPUT_LEN_RANGE[1])


# --------------------------------------------------------------------------- the other parts
def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def model_shape(model_path: str, dtype: str) -> ModelShape:
    from vllm_actors.models.config import ModelConfig

    config = ModelConfig.from_path(model_path)
    dtype_bytes = 4 if dtype in ("float32", "float") else 2
    return ModelShape(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers, num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
        tie_word_embeddings=config.tie_word_embeddings, qk_norm=config.qk_norm, dtype_bytes=dtype_bytes,
    )


def compute_floor(
    args: argparse.Namespace, shape: ModelShape, workload: Workload
) -> tuple[GpuCeilings | None, Floor | None]:
    ceilings: GpuCeilings | None = None
    bandwidth, rate = args.bandwidth, args.matmul_rate
    if (bandwidth is None or rate is None) and not args.no_floor:
        if _cuda_available():
            ceilings = measure_ceilings()
            bandwidth = bandwidth if bandwidth is not None else ceilings.bandwidth
            rate = rate if rate is not None else ceilings.matmul_rate
        else:
            log.warning("no CUDA device: the GPU's ceilings are not measured (give --bandwidth and --matmul-rate "
                        "to compute the floor anyway)")
    if bandwidth is None or rate is None:
        return ceilings, None
    floor = workload_floor(
        [len(prompt) for prompt in workload.prompts], workload.max_tokens, shape,
        bandwidth=bandwidth, matmul_rate=rate, max_num_seqs=args.max_num_seqs,
    )
    log.info("floor", seconds=round(floor.seconds, 3), tok_s=round(floor.tokens_per_s, 1))
    return ceilings, floor


def run_peer(args: argparse.Namespace, model_path: str, workload: Workload, random_weights: bool) -> Any:
    if not _cuda_available():
        log.warning("no CUDA device: the transformers peer is skipped")
        return None
    from vllm_actors.bench.peer_transformers import run_transformers_peer

    subset = workload.head(args.peer_num_requests or len(workload))
    return run_transformers_peer(
        model_path, subset.prompts, subset.max_tokens, random_weights=random_weights, temperature=TEMPERATURE,
        seed=args.seed, attn_implementation=args.peer_attn, timeout_s=args.peer_timeout,
    )


def run_vllm_peer(
    args: argparse.Namespace, model_path: str, load_format: str, workload: Workload, scratch_dir: Path,
    vocab_size: int, mix: str = "none",
) -> dict[str, Any]:
    """peer_vllm.py in a process of its own, under vLLM's PYTHONPATH; its JSON result (with
    ``error`` when it failed, and what it measured before that)."""
    import subprocess

    from vllm_actors.bench import peer_vllm

    script = scratch_dir / "peer_vllm.py"  # run from a folder of its own: bench/'s modules shadow nothing
    shutil.copyfile(peer_vllm.__file__, script)
    workload_path, result_path = scratch_dir / "vllm_workload.json", scratch_dir / "vllm_result.json"
    content: dict[str, Any] = {"prompts": workload.prompts, "max_tokens": workload.max_tokens}
    if mix != "none":  # plain and mixed runs, with the tokenizer (throughput_mix.py)
        content["mix"] = throughput_mix.mix_fields(mix, len(workload))
    workload_path.write_text(json.dumps(content))
    command = [
        args.vllm_python, str(script), "--model", model_path, "--workload", str(workload_path),
        "--out", str(result_path), "--load-format", load_format, "--dtype", args.dtype,
        "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed),
        "--runs", str(max(1, args.runs)), "--warmup-requests", str(args.warmup_requests),
        "--batch1-input-len", str(args.batch1_input_len), "--batch1-output-len", str(args.batch1_output_len),
        "--vocab-size", str(vocab_size), "--tensor-parallel-size", str(args.tensor_parallel_size),
        *(["--enforce-eager"] if args.enforce_eager else []),
        *(["--no-enable-prefix-caching"] if not args.enable_prefix_caching else []),
        *(["--no-batch1"] if args.no_batch1 else []),
    ]
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1")
    if args.vllm_pythonpath:
        env["PYTHONPATH"] = args.vllm_pythonpath
    log.info("starting the vLLM peer", command=" ".join(command))
    completed = subprocess.run(command, env=env, timeout=args.peer_timeout, check=False, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    (Path(args.out) / "vllm_peer.log").write_text(completed.stdout)
    result: dict[str, Any] = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if completed.returncode != 0:
        result["error"] = f"exit {completed.returncode}: " + " | ".join(completed.stdout.splitlines()[-12:])
    return result


def _config_record(args: argparse.Namespace, load_format: str, workload: Workload) -> dict[str, Any]:
    record: dict[str, Any] = dict(vars(args))
    record["load_format"] = load_format
    record["model_description"] = (
        f"{args.model_shape} shape, random weights (load_format=dummy), TP={args.tensor_parallel_size}"
        if args.model is None
        else f"{args.model} (load_format={load_format})"
    )
    record["workload"] = {"num_requests": len(workload), "prompt_tokens": workload.prompt_tokens,
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
def _part(report: BenchReport, name: str, out_json: Path) -> Iterator[None]:
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
def _run_ours(
    args: argparse.Namespace, model_path: str, load_format: str, shape: ModelShape, workload: Workload,
    report: BenchReport, scratch_dir: Path, out_json: Path,
) -> bool:
    """Part 1: the timed run, its metrics and batch-1 on the same engine. False if the run failed."""
    try:
        started = time.perf_counter()
        with make_llm(args, model_path, load_format, args.enforce_eager) as llm:
            report.startup_s = time.perf_counter() - started
            session = EngineSession(llm)
            steps, start_wall = measure_ours(args, session, workload, report, scratch_dir)
            report.steps = step_series(steps, start_wall)
            write_json(report, out_json)
            if not args.no_batch1:
                key = _batch1_key(args.enforce_eager)
                if not args.no_events:
                    with _part(report, f"batch1_{key}", out_json):
                        report.batch1[key] = session.batch1(args, args.enforce_eager, shape.vocab_size)
                with _part(report, "batch1_client", out_json):
                    report.batch1_client = session.batch1_client(args, shape.vocab_size)
    except Exception as exc:
        log.exception("the timed run failed")
        report.errors["ours"] = f"{type(exc).__name__}: {exc}"
        write_json(report, out_json)
        return False
    finally:
        events = scratch_dir / "events.jsonl"
        if args.keep_events and events.is_file():
            with events.open("rb") as source, gzip.open(Path(args.out) / "events.jsonl.gz", "wb") as target:
                shutil.copyfileobj(source, target)
        if args.trace and events.is_file():
            with _part(report, "trace", out_json):
                bound = trace_file.max_trace_bytes(args.trace_max_mb)
                written = trace_file.write_trace(trace_file.read_dump(events), args.trace, bound)
                report.config["trace"] = trace_file.trace_record(written)
    return True


def _run_other_batch1(
    args: argparse.Namespace, model_path: str, load_format: str, shape: ModelShape, workload: Workload,
    report: BenchReport, out_json: Path,
) -> None:
    """Part 2: batch-1 on a second engine with CUDA graphs the other way (the first is shut down)."""
    other = not args.enforce_eager
    key = _batch1_key(other)
    with _part(report, f"batch1_{key}", out_json), make_llm(args, model_path, load_format, other) as llm:
        session = EngineSession(llm)
        session.warm_up(workload, max(1, args.warmup_requests))
        report.batch1[key] = session.batch1(args, other, shape.vocab_size)


def run(args: argparse.Namespace) -> tuple[BenchReport, int]:
    """Every part in order; returns the report and the exit status (1 if our timed run failed)."""
    started = time.perf_counter()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_json = out_dir / "results.json"

    workload = make_workload(args.num_requests, args.max_input_len, args.max_output_len, args.seed)
    if is_default_workload(args) and workload.output_tokens != EXPECTED_OUTPUT_TOKENS:
        raise AssertionError(f"the default workload has {workload.output_tokens} output tokens, "
                             f"expected {EXPECTED_OUTPUT_TOKENS}")
    load_format = args.load_format or ("dummy" if args.model is None else "auto")

    with tempfile.TemporaryDirectory(prefix="vllm-actors-bench-") as scratch:
        scratch_dir = Path(scratch)
        model_path = args.model or str(write_model_dir(scratch_dir / f"{args.model_shape}-shape",
                                                       MODEL_SHAPES[args.model_shape]))
        shape = model_shape(model_path, args.dtype)
        if shape.vocab_size <= TOKEN_ID_RANGE[1]:
            log.warning("the model's vocabulary is smaller than the workload's token ids: folding them",
                        vocab_size=shape.vocab_size)
            workload = workload.fit_vocab(shape.vocab_size)
        report = BenchReport(config=_config_record(args, load_format, workload))
        if args.mix != "none":
            mix = throughput_mix.run(args, workload, load_format, scratch_dir, run_vllm_peer)
            print(throughput_mix.format_mix(mix))
            return report, 0 if "error" not in mix.get("ours", {}) else 1

        if args.no_events:
            os.environ[DISABLE_EVENTS_ENV] = "1"  # read by every actor of the group at its start
        if args.trace:  # the whole run in the store's log, read by the metrics store at its start
            os.environ.update(trace_file.retention_env(args.trace_max_events))
        ok = _run_ours(args, model_path, load_format, shape, workload, report, scratch_dir, out_json)
        for name in (DISABLE_EVENTS_ENV, *trace_file.retention_env(0)):
            os.environ.pop(name, None)
        if ok and not args.no_batch1 and not args.batch1_same_engine_only and not args.no_events:
            _run_other_batch1(args, model_path, load_format, shape, workload, report, out_json)
        with _part(report, "floor", out_json):
            report.ceilings, report.floor = compute_floor(args, shape, workload)
        if ok and args.peer == "transformers":
            with _part(report, "peer", out_json):
                report.peer = run_peer(args, model_path, workload, random_weights=load_format == "dummy")
        if args.peer == "vllm":
            with _part(report, "peer_vllm", out_json):
                report.peer_vllm = run_vllm_peer(args, model_path, load_format, workload, scratch_dir,
                                                 shape.vocab_size)

    report.total_seconds = time.perf_counter() - started
    with _part(report, "plot", out_json):
        if write_png(report, out_dir / "throughput.png"):
            log.info("plot written", path=str(out_dir / "throughput.png"))
    return report, 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging(args.log_level)
    report, status = run(args)
    print(format_table(report))
    print(f"\nresults: {Path(args.out) / 'results.json'}")
    return status
