"""Where one engine step's time goes, on the GPU: phases of the worker's step and a torch profile.

Runs the in-process engine (no sockets) on the Qwen3-0.6B shape with random weights, decodes at a
few batch sizes, and times, with a device synchronisation around each: the worker's Python work,
the runner's host input preparation, the forward pass (CUDA-graph replay or eager), and sampling.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from vllm_actors.bench.throughput_workload import QWEN3_0_6B_CONFIG
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams


def _timed(store: dict[str, list[float]], name: str, function):  # noqa: ANN001, ANN202
    def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = function(*args, **kwargs)
        torch.cuda.synchronize()
        store[name].append((time.perf_counter() - started) * 1e3)
        return result

    return wrapper


def profile(batch_size: int, enforce_eager: bool, model_dir: str, steps: int,
            prefix_caching: bool = True) -> dict[str, Any]:
    config = EngineConfig(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                          max_model_len=4096, enforce_eager=enforce_eager, gpu_memory_utilization=0.6,
                          enable_prefix_caching=prefix_caching)
    engine = InProcessEngine(config, tokenizer=None)
    worker: Any = engine.worker  # its methods and the runner's are wrapped in timers below
    runner: Any = worker.runner
    times: dict[str, list[float]] = defaultdict(list)
    runner._host_inputs = _timed(times, "host_inputs", runner._host_inputs)
    runner.execute = _timed(times, "runner.execute", runner.execute)
    sampler = worker.sampler
    worker.sampler = _timed(times, "sampler", sampler)
    worker.execute = _timed(times, "worker.execute", worker.execute)
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=steps + 16)
    for index in range(batch_size):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": [(index * 7 + j) % 10000 for j in range(512)]},
                                     params))
    while engine.scheduler.stats.num_steps < 8:  # prefill and warm-up
        engine.step()
    times.clear()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - started) * 1e3 / steps
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            engine.step()
    python = cProfile.Profile()  # the host side: where Python time goes (kernel launches included)
    python.enable()
    for _ in range(5):
        engine.step()
    python.disable()
    python_table = io.StringIO()
    pstats.Stats(python, stream=python_table).sort_stats("tottime").print_stats(25)
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
    cuda_table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    for request_id in list(engine.frontend._requests):
        engine.abort(request_id)
    engine.run_until_idle()
    return {
        "batch_size": batch_size,
        "enforce_eager": enforce_eager,
        "wall_ms_per_step": wall,
        "phases_ms_median": {name: sorted(values)[len(values) // 2] for name, values in times.items() if values},
        "cpu_table": table,
        "cuda_table": cuda_table,
        "python_table": python_table.getvalue(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--eager", action="store_true", help="also profile without CUDA graphs")
    parser.add_argument("--eager-only", action="store_true",
                        help="only without CUDA graphs (two engines in one process do not fit in memory)")
    parser.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    parser.add_argument("--out", default="results/profile.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stderr.write("profile_step needs CUDA\n")
        return 2
    results = []
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "config.json").write_text(json.dumps(QWEN3_0_6B_CONFIG))
        for batch_size in (int(b) for b in args.batch_sizes.split(",")):
            modes = [True] if args.eager_only else [False, True] if args.eager else [False]
            for eager in modes:
                result = profile(batch_size, eager, folder, args.steps, args.prefix_caching)
                results.append(result)
                sys.stdout.write(f"\n=== batch {batch_size} eager={eager}: {result['wall_ms_per_step']:.2f} ms/step\n")
                for name, value in result["phases_ms_median"].items():
                    sys.stdout.write(f"  {name:20s} {value:8.3f} ms\n")
                sys.stdout.write(str(result["cuda_table"]) + "\n")
                sys.stdout.write(str(result["cpu_table"]) + "\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return 0

