"""Where a long prefill's time goes (needs a CUDA GPU): the in-process engine on a model shape with random
weights prefills one uncached prompt of ``--context`` tokens in chunks; each chunk's step is timed with a
device synchronisation around it, and a torch profile of the whole prefill groups the GPU kernels into
attention, GEMMs and the rest. Compares with the FLOPs a chunk needs (``benchmarks/lib/floor.py``)."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.lib.profile_step import _timed
from vllm_actors.bench.serve_server import write_model_dir
from vllm_actors.bench.throughput_workload import MODEL_SHAPES
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.sampling import SamplingParams

KERNEL_GROUPS = (("attention", ("flash", "attn", "paged", "varlen", "fmha")),
                 ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "sm90")))


def kernel_group(name: str) -> str:
    lowered = name.lower()
    for group, needles in KERNEL_GROUPS:
        if any(needle in lowered for needle in needles):
            return group
    return "other"


def _prefill(engine: InProcessEngine, request_id: str, context: int, seed: int) -> float:
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 30000) for _ in range(context)]
    started = time.perf_counter()
    engine.submit(engine.prepare(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1)))
    engine.run_until_idle()
    return time.perf_counter() - started


def profile(args: argparse.Namespace) -> dict[str, Any]:
    model = write_model_dir(Path(tempfile.mkdtemp()) / "model",
                            {**MODEL_SHAPES[args.model_shape], "max_position_embeddings": max(args.context, 131072)})
    config = EngineConfig(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                          max_model_len=args.context + 16, enable_prefix_caching=False,
                          max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.85)
    engine = InProcessEngine(config, tokenizer=None)
    runner: Any = engine.worker.runner
    steps: dict[str, list[float]] = defaultdict(list)
    runner.execute = _timed(steps, "step_ms", runner.execute)
    _prefill(engine, "warm", min(args.context, 16384), seed=1)  # compiles, warms the allocator
    steps.clear()
    untimed = _prefill(engine, "plain", args.context, seed=2)
    step_ms = list(steps["step_ms"])
    steps.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _prefill(engine, "profiled", args.context, seed=3)
    groups: dict[str, float] = defaultdict(float)
    kernels = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)
        if device_us <= 0:
            continue
        groups[kernel_group(event.key)] += device_us / 1e3
        kernels.append({"name": event.key[:120], "ms": device_us / 1e3, "calls": event.count})
    kernels.sort(key=lambda k: -k["ms"])
    return {"model_shape": args.model_shape, "context": args.context,
            "max_num_batched_tokens": runner.max_num_tokens, "attention": repr(runner.model.attn_backend.prefill),
            "prefill_s_unprofiled": untimed, "step_ms_synchronised": step_ms, "step_ms_sum": sum(step_ms),
            "kernel_ms_by_group": dict(groups), "top_kernels": kernels[:args.top]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama-3.2-1b")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("results/prefill_profile.json"))
    args = parser.parse_args(argv)
    report = profile(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("top_kernels", "step_ms_synchronised")}, indent=1))
    print("per-chunk step ms:", ", ".join(f"{ms:.0f}" for ms in report["step_ms_synchronised"]))
    for kernel in report["top_kernels"]:
        print(f"{kernel['ms']:9.1f} ms {kernel['calls']:6d}x  {kernel['name']}")
