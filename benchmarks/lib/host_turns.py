"""``benchmarks/host_turns.py``: the time to first token of the next turn of a long conversation whose
prefix was pushed out of the GPU's KV pool, with host memory for the evicted blocks and without:
(a) ours with the host KV tier (``kv_cache_offload_gb``) restoring them, (b) ours recomputing them,
(c) vLLM with its CPU KV offloading (``kv_offloading_size``) and (d) vLLM without it.

Each engine of ``--engines`` runs in each mode of ``--modes`` (``host``, ``recompute``) in a process of
its own, one after the other, the GPU left to each alone: ours as ``python -m
benchmarks.lib.host_turns_ours``, vLLM as host_turns_peer.py copied to a scratch folder and run with
vLLM's Python and PYTHONPATH (a vLLM whose offloading fails to start is recorded as that mode's
error; its recompute mode runs all the same). Both run the same cycles (host_turns_peer.run_cycles,
whose docstring says how they are measured) with the same sizes (host_turns_plan.plan_turns: turn
1's prompt, a GPU pool of ``num_gpu_blocks_override`` blocks, the fillers that push turn 1 out of it,
the host memory that keeps it) and the same random prompts, on a model directory of ``--model-shape``
with random weights (``max_position_embeddings`` raised to the context where the shape's is shorter,
which vLLM needs: long_context_model.model_setup).

Writes ``results.json`` and ``host_turns.md`` under ``--out``, and each process's log and result; a
run too long for one call is split over calls with ``--append`` (e.g. ours, then vLLM), each adding
its engines and modes to the same report.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.lib import host_turns_peer
from benchmarks.lib.host_turns_plan import TurnsPlan, kv_bytes_per_token, plan_turns
from benchmarks.lib.host_turns_report import (
    ENGINE_ORDER,
    MODE_ORDER,
    add_result,
    build_rows,
    format_markdown,
    load_report,
    new_report,
    write_report,
)
from benchmarks.lib.long_context_model import model_setup, parse_context
from benchmarks.lib.long_context_process import ours_env, run_process
from vllm_actors.bench.throughput_workload import MODEL_SHAPES

# settings that must match for --append to add to an earlier report
SAME_SETTINGS = ("model", "model_shape", "dtype", "load_format", "tensor_parallel_size", "max_num_batched_tokens",
                 "plan", "seed")


def _context(text: str) -> int:
    try:
        return parse_context(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/host_turns.py", description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model and engines")
    model.add_argument("--model", default=None,
                       help="a Hugging Face directory (default: --model-shape, random weights)")
    model.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama-3.2-1b")
    model.add_argument("--load-format", choices=("auto", "dummy"), default=None,
                       help="default: dummy without --model, auto with it")
    model.add_argument("--dtype", default="bfloat16")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    model.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="the prefill chunk; default: each engine's")
    model.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    model.add_argument("--engines", nargs="+", choices=ENGINE_ORDER, default=["ours", "vllm"],
                       help="each mode of each runs in its own process, one after the other")
    model.add_argument("--modes", nargs="+", choices=MODE_ORDER, default=list(MODE_ORDER),
                       help="host: host memory for evicted KV blocks (ours: the host KV tier, vLLM: CPU offloading); "
                            "recompute: none")
    model.add_argument("--vllm-python", default=sys.executable, help="the Python that runs vLLM")
    model.add_argument("--vllm-pythonpath", default="/tmp/vsite",
                       help="PYTHONPATH of vLLM's process (where its packages are; '' to inherit ours)")

    turns = parser.add_argument_group("the conversation")
    turns.add_argument("--context", type=_context, default=204800,
                       help="max_model_len, which turn 2 fills but a margin: N, Nk = N x 1,024, NM = N x 1,000,000")
    turns.add_argument("--turn-output", type=int, default=64, help="tokens turn 1 decodes (part of turn 2's prompt)")
    turns.add_argument("--new-tokens", type=int, default=512, help="turn 2's tokens past turn 1's prompt and output")
    turns.add_argument("--block-size", type=int, default=16, help="the KV block of both engines")
    turns.add_argument("--pool-factor", type=float, default=1.3, help="the GPU pool, in contexts")
    turns.add_argument("--filler-factor", type=float, default=1.5, help="the fillers' tokens, in GPU pools")
    turns.add_argument("--host-gb", type=float, default=None,
                       help="host memory in GiB (default: turn 1's and the fillers' KV and 10%%)")
    turns.add_argument("--repeats", type=int, default=3, help="measured cycles per engine and mode")
    turns.add_argument("--warmup-cycles", type=int, default=0, help="discarded cycles first")
    turns.add_argument("--seed", type=int, default=0)

    output = parser.add_argument_group("output")
    output.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine process")
    output.add_argument("--append", action="store_true", help="add to the report already under --out")
    output.add_argument("--out", default="results/host_turns", help="directory for results.json and host_turns.md")
    return parser


def engine_command(args: argparse.Namespace, engine: str, scratch: Path,
                   common: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one engine's process (``common``: host_turns_peer.py's arguments)."""
    if engine == "ours":
        return [sys.executable, "-m", "benchmarks.lib.host_turns_ours", "--engine", "ours", *common], ours_env()
    script = scratch / "host_turns_peer.py"  # run from a folder of its own: lib/'s modules shadow nothing
    shutil.copyfile(host_turns_peer.__file__, script)
    env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
               HF_HUB_OFFLINE="1")
    if args.vllm_pythonpath:
        env["PYTHONPATH"] = args.vllm_pythonpath
    return [args.vllm_python, str(script), "--engine", engine, *common], env


def run_engine(args: argparse.Namespace, engine: str, mode: str, model_path: str, vocab_size: int, plan_path: Path,
               scratch: Path, out_dir: Path) -> tuple[dict[str, Any], str, str | None]:
    """One engine and mode's process; its result (what it wrote, even if it failed), its log's name, its error."""
    name = f"{engine}-{mode}"
    result_path = out_dir / f"{name}.json"
    result_path.unlink(missing_ok=True)
    common = [
        "--mode", mode, "--plan", str(plan_path), "--model", model_path, "--out", str(result_path),
        "--repeats", str(args.repeats), "--warmup-cycles", str(args.warmup_cycles), "--load-format", args.load_format,
        "--dtype", args.dtype, "--tensor-parallel-size", str(args.tensor_parallel_size),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--seed", str(args.seed),
        "--vocab-size", str(vocab_size),
        *(["--max-num-batched-tokens", str(args.max_num_batched_tokens)] if args.max_num_batched_tokens else []),
    ]
    command, env = engine_command(args, engine, scratch, common)
    log_path = out_dir / f"{name}.log"
    print(f"{name}: {' '.join(command)}", flush=True)
    error = run_process(command, env, log_path, args.timeout)
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    return result, log_path.name, error


def _config(args: argparse.Namespace, description: str, overrides: dict[str, Any], plan: TurnsPlan) -> dict[str, Any]:
    config = {k: v for k, v in vars(args).items() if k not in ("vllm_python", "vllm_pythonpath", "append", "timeout")}
    if args.model is not None:
        config["model_shape"] = None  # --model's config.json gives the shape
    config.update(model_description=description, model_overrides=overrides, plan=plan.to_dict(),
                  python=sys.version.split()[0], vllm_python=args.vllm_python, vllm_pythonpath=args.vllm_pythonpath)
    return config


def _start_report(args: argparse.Namespace, config: dict[str, Any], path: Path) -> dict[str, Any]:
    previous = load_report(path) if args.append else None
    if previous is None:
        return new_report(config)
    differ = [name for name in SAME_SETTINGS if previous["config"].get(name) != config.get(name)]
    if differ:
        raise ValueError(f"--append: {path} was measured with other settings ({', '.join(differ)}); give another --out")
    previous["config"] = config
    return previous


def run(args: argparse.Namespace) -> tuple[dict[str, Any], int]:
    if args.repeats < 1 or args.warmup_cycles < 0:
        raise ValueError("--repeats must be at least 1 and --warmup-cycles at least 0")
    args.load_format = args.load_format or ("dummy" if args.model is None else "auto")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    status = 0
    with tempfile.TemporaryDirectory(prefix="host-turns-") as scratch_name:
        scratch = Path(scratch_name)
        setup = model_setup(args.model, args.model_shape, scratch, args.context)
        dtype_bytes = 4 if args.dtype in ("float32", "float") else 2
        plan = plan_turns(args.context, args.turn_output, args.new_tokens, args.block_size,
                          kv_bytes_per_token(setup.config, dtype_bytes), args.pool_factor, args.filler_factor,
                          args.host_gb)
        plan_path = scratch / "plan.json"
        plan_path.write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
        report = _start_report(args, _config(args, setup.description, setup.overrides, plan),
                               out_dir / "results.json")
        write_report(report, out_dir)
        for engine in args.engines:
            for mode in args.modes:
                result, log, error = run_engine(args, engine, mode, setup.path, int(setup.config["vocab_size"]),
                                                plan_path, scratch, out_dir)
                add_result(report, engine, mode, result, log, error)
                build_rows(report)
                write_report(report, out_dir)
                if error or result.get("error"):
                    status = 1
                    print(f"{engine} {mode} failed: {error or result.get('error')} ({out_dir / log})", flush=True)
    return report, status


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report, status = run(args)
    except ValueError as error:
        raise SystemExit(f"benchmarks/host_turns.py: {error}") from None
    print(format_markdown(report))
    return status
