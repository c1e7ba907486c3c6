"""Where a long prefill's time goes (needs a CUDA GPU): the in-process engine on a model shape with random
weights prefills one uncached prompt of ``--context`` tokens in chunks; each chunk's step is timed with a
device synchronisation around it, and a torch profile of the whole prefill groups the GPU kernels into
attention, GEMMs and the rest. Compares with the FLOPs a chunk needs (``benchmarks/lib/floor.py``).
With ``--decode-tokens N``, then N batch-1 decode steps at that context under the profiler: their wall time
a token against the kernels' (launches and GPU time a step, by kernel), which says how much of a step lies
between its kernels rather than in them."""

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
from vllm_actors.device_probe import default_block_size
from vllm_actors.kernels import kv_quant
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


def _prompt(context: int, seed: int, vocab_size: int = 30000) -> list[int]:
    rng = random.Random(seed)
    high = min(vocab_size, 30000)
    return [rng.randrange(high // 30, high) for _ in range(context)]


def _tokens(outputs: list[Any], request_id: str) -> int:
    return max((len(o.outputs[0].token_ids) for o in outputs if o.request_id == request_id), default=0)


def _step_tokens(engine: InProcessEngine, request_id: str, done: int) -> int:
    """One engine step; the request's tokens so far (a request gone without them raises, not loops)."""
    if not engine.has_unfinished:
        raise RuntimeError(f"request {request_id!r} ended after {done} tokens")
    return max(done, _tokens(engine.step(), request_id))


DECODE_WARM = 8  # decode steps before the profiled ones (graphs replayed, the allocator warm)


def decode_budget(tokens: int) -> int:
    """Tokens the decode profile's request generates for ``tokens`` profiled steps."""
    return DECODE_WARM + tokens + 4


def max_model_len(context: int, decode_tokens: int) -> int:
    """The engine's limit: the prompt, then the decode profile's tokens, and a margin."""
    return context + decode_budget(decode_tokens) + 16


def profile_decode(engine: InProcessEngine, context: int, tokens: int, top: int) -> dict[str, Any]:
    """``tokens`` decode steps of one request after its ``context``-token prompt (8 more decoded first,
    unprofiled): wall ms a token, and the kernels' launches and GPU ms a step."""
    request_id, warm = "decode", DECODE_WARM
    params = SamplingParams(max_tokens=decode_budget(tokens), ignore_eos=True)
    prompt = _prompt(context, seed=4, vocab_size=engine.model_config.vocab_size)
    engine.submit(engine.prepare(request_id, {"prompt_token_ids": prompt}, params))
    done = 0
    while done < warm:
        done = _step_tokens(engine, request_id, done)
    start_tokens = done
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CUDA if cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        while done < start_tokens + tokens:
            done = _step_tokens(engine, request_id, done)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
    engine.run_until_idle()
    steps = done - start_tokens
    kernels = [{"name": e.key[:120], "ms_per_step": (getattr(e, "device_time_total", 0.0) or 0.0) / 1e3 / steps,
                "calls_per_step": e.count / steps} for e in prof.key_averages()
               if (getattr(e, "device_time_total", 0.0) or 0.0) > 0]
    kernels.sort(key=lambda k: -k["ms_per_step"])
    gpu_ms = sum(k["ms_per_step"] for k in kernels)
    return {"context": context, "steps": steps, "wall_ms_per_token": wall * 1e3 / steps,
            "kernel_ms_per_step": gpu_ms, "launches_per_step": sum(k["calls_per_step"] for k in kernels),
            "between_kernels_ms_per_step": wall * 1e3 / steps - gpu_ms, "top_kernels": kernels[:top]}


def _prefill(engine: InProcessEngine, request_id: str, context: int, seed: int) -> float:
    started = time.perf_counter()
    prompt = {"prompt_token_ids": _prompt(context, seed)}
    engine.submit(engine.prepare(request_id, prompt, SamplingParams(max_tokens=1)))
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
                          max_model_len=max_model_len(args.context, args.decode_tokens), enable_prefix_caching=False,
                          max_num_batched_tokens=args.max_num_batched_tokens, gpu_memory_utilization=0.85,
                          kv_cache_dtype=args.kv_cache_dtype,
                          block_size=args.block_size or default_block_size("bfloat16"))
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
    if recorder is not None and kv_quant.is_fp8(runner.kv_caches[0][0].dtype):
        probe = {"error": "fp8 KV cache: flash-attn reads the bf16 staging (kernels/fp8_prefill_stage.py)"}
    elif recorder is not None:
        probe = probe_last_chunk(recorder.func, padded_call(runner, recorder))
    decode = profile_decode(engine, args.context, args.decode_tokens, args.top) if args.decode_tokens else None
    return {"model_shape": args.model_shape, "context": args.context, "block_size": runner.block_size, "decode": decode,
            "kv_cache_dtype": args.kv_cache_dtype,
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
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size (default: the engine's for this device, device_probe.py)")
    parser.add_argument("--decode-tokens", type=int, default=0,
                        help="then profile this many batch-1 decode steps at the context (0: none)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8", "fp8_e4m3"), default="auto")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", type=Path, default=Path("results/prefill_profile.json"))
    args = parser.parse_args(argv)
    report = profile(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k not in ("top_kernels", "step_ms_synchronised", "decode")},
                     indent=1))
    print("per-chunk step ms:", ", ".join(f"{ms:.0f}" for ms in report["step_ms_synchronised"]))
    for kernel in report["top_kernels"]:
        print(f"{kernel['ms']:9.1f} ms {kernel['calls']:6d}x  {kernel['name']}")
    decode = report["decode"]
    if decode:
        print(f"decode at {decode['context']}: {decode['wall_ms_per_token']:.3f} ms/token wall, "
              f"{decode['kernel_ms_per_step']:.3f} ms of kernels in {decode['launches_per_step']:.0f} launches a step, "
              f"{decode['between_kernels_ms_per_step']:.3f} ms between them")
        for kernel in decode["top_kernels"]:
            print(f"{kernel['ms_per_step'] * 1e3:9.1f} us {kernel['calls_per_step']:6.1f}x  {kernel['name']}")
