"""Timing helpers of the kernel microbenchmark (``benchmarks.lib.kernel_micro``): medians of
``triton.testing.do_bench``, per-call times replayed from CUDA graphs, and a GPU spin-up."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def do_bench(fn: Callable[[], object], args: argparse.Namespace) -> float:
    import triton.testing

    try:
        return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, return_mode="median"))
    except TypeError:  # a triton without return_mode
        return float(triton.testing.do_bench(fn, warmup=args.warmup_ms, rep=args.rep_ms, quantiles=[0.5])[0])


def do_bench_graph(fn: Callable[[], object], args: argparse.Namespace, calls: int = 20) -> float:
    """Per-call time of fn replayed from a CUDA graph holding `calls` calls of it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return do_bench(graph.replay, args) / calls


def spin_up(seconds: float = 0.2) -> None:
    """Keep the GPU busy for a moment so that timings start at full clocks."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return
