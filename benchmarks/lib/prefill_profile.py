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


class LastCall:
    """Wraps flash-attn's varlen function: keeps the keyword arguments of its latest call."""

    def __init__(self, func: Any) -> None:
        self.func, self.kwargs = func, dict[str, Any]()

    def __call__(self, **kwargs: Any) -> Any:
        self.kwargs = kwargs
        return self.func(**kwargs)


def _time_ms(fn: Any, reps: int = 5) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _variants(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The call as made, then its first sequence alone with the full-width table, the table cut to the
    blocks it uses, and that with host max_seqlen hints."""
    qsl, used, table = kwargs["cu_seqlens_q"], kwargs["seqused_k"], kwargs["page_table"]
    rows, keys = int(qsl[1] - qsl[0]), int(used[0])
    one = {**kwargs, "q": kwargs["q"][:rows], "cu_seqlens_q": qsl[:2].contiguous(), "seqused_k": used[:1].contiguous(),
           "page_table": table[:1].contiguous()}
    cut = {**one, "page_table": table[:1, : -(-keys // kwargs["k"].shape[1])].contiguous()}
    return {"as_engine": kwargs, "one_sequence": one, "table_cut": cut,
            "table_cut_hinted": {**cut, "max_seqlen_q": rows, "max_seqlen_k": keys}}


def probe_last_chunk(func: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The last chunk's flash-attn call replayed with the engine's metadata, then trimmed (``_variants``):
    does the engine's metadata (padded sequences, a table as wide as max_model_len) slow the kernel?"""
    if not kwargs:
        return {"error": "flash-attn took no call"}
    qsl, used = kwargs["cu_seqlens_q"], kwargs["seqused_k"]
    rows, keys = int(qsl[1] - qsl[0]), int(used[0])
    q = kwargs["q"]
    pairs = rows * (keys - rows) + rows * (rows + 1) // 2
    flops = 4.0 * q.shape[1] * q.shape[2] * pairs
    report: dict[str, Any] = {"q_rows": rows, "keys": keys, "sequences": qsl.shape[0] - 1,
                              "table_width": kwargs["page_table"].shape[1], "block_size": kwargs["k"].shape[1]}
    for name, kw in _variants(kwargs).items():
        try:
            ms = _time_ms(lambda kw=kw: func(**kw))
            report[name] = {"ms": ms, "tflops": flops / (ms * 1e-3) / 1e12}
        except Exception as exc:  # a hint the installed version refuses is a finding, not a failure
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return report


def padded_call(runner: Any, recorder: LastCall) -> dict[str, Any]:
    """The arguments the padded graph's flash-attn call reads (its static inputs hold the last step's
    metadata), or the eager call's as recorded."""
    padded = getattr(runner, "_padded", None)
    if padded is None or not padded.graphs:
        return dict(recorder.kwargs)
    static = padded.static
    qsl = static["query_start_loc"]
    rows = int(qsl[-1])
    k_cache, v_cache = runner.kv_caches[0]
    config = runner.model.config
    q = torch.randn(rows, config.num_attention_heads, k_cache.shape[-1], device=k_cache.device, dtype=k_cache.dtype)
    return {"q": q, "k": k_cache, "v": v_cache, "cu_seqlens_q": qsl, "seqused_k": static["seq_lens"],
            "page_table": static["block_tables"], "softmax_scale": k_cache.shape[-1] ** -0.5, "causal": True}


def profile(args: argparse.Namespace) -> dict[str, Any]:
    positions = 2 * max(args.context, 131072)  # above max_model_len (context + 16)
    model = write_model_dir(Path(tempfile.mkdtemp()) / "model",
                            {**MODEL_SHAPES[args.model_shape], "max_position_embeddings": positions})
    config = EngineConfig(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
                          max_model_len=args.context + 16, enable_prefix_caching=False,
                          max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.85,
                          **({"block_size": args.block_size} if args.block_size else {}))
    engine = InProcessEngine(config, tokenizer=None)
    runner: Any = engine.worker.runner
    steps: dict[str, list[float]] = defaultdict(list)
    runner.execute = _timed(steps, "step_ms", runner.execute)
    _prefill(engine, "warm", min(args.context, 16384), seed=1)  # compiles, warms the allocator
    flash = getattr(runner.model.attn_backend, "prefill", None)
    recorder = LastCall(flash.function()) if flash is not None else None
    if recorder is not None:
        flash._varlen = recorder
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
    probe = {"error": "no flash-attn prefill"}
    if recorder is not None:
        probe = probe_last_chunk(recorder.func, padded_call(runner, recorder))
    return {"model_shape": args.model_shape, "context": args.context, "block_size": runner.block_size,
            "max_num_batched_tokens": runner.max_num_tokens, "attention": repr(runner.model.attn_backend.prefill),
            "padded_graphs": sorted(getattr(runner._padded, "graphs", None) or []),
            "prefill_s_unprofiled": untimed, "step_ms_synchronised": step_ms, "step_ms_sum": sum(step_ms),
            "kernel_ms_by_group": dict(groups), "attention_probe": probe,
            "top_kernels": kernels[:args.top]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="llama-3.2-1b")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
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
