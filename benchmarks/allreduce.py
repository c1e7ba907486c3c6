"""All-reduce at decode sizes on the GPUs of one host: NCCL against torch's symmetric-memory one-shot
all-reduce (every rank reads its peers' buffers over NVLink; no NVLink multicast).

    python3 benchmarks/allreduce.py [--hidden 4096] [--batches 1 2 4 8 16 32 64 128 256] \
        [--dtype bfloat16] [--out results/allreduce.json]

One process per GPU (``torch.multiprocessing.spawn``; the ranks meet at a file store in a fresh
temporary directory, no port). For each batch size (a decode step's all-reduce is batch x hidden
elements) and each method it times ``--iters`` all-reduces captured in one CUDA graph (how the
decode graphs run them) and reports microseconds per all-reduce, the median of ``--repeats``
replays; eager NCCL (no graph) for reference. Each method's result is checked against NCCL's.

Methods: ``nccl`` (dist.all_reduce), ``nccl-eager``, ``symm-one-shot``
(torch.ops.symm_mem.one_shot_all_reduce on a symmetric buffer, the input copied in first, as an
engine would) and ``symm-two-shot`` (two_shot_all_reduce_, in place: reduce-scatter then
all-gather over peer loads); and what a decoder runs after a row-parallel projection, the
all-reduce then the residual add and RMSNorm: ``nccl+norm``, ``two-shot+norm`` and ``fused-norm``
(`kernels/allreduce_norm.py`: both in one kernel). Multicast stays off: NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are set before torch starts, and the script refuses to run if
either is set otherwise; no multimem operation is called.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

_NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _keep_multicast_off() -> None:
    for name, value in _NO_MULTICAST.items():
        if os.environ.setdefault(name, value) != value:
            raise SystemExit(f"{name}={os.environ[name]}: this benchmark runs with NVLink multicast off only ({value})")


def _time_graph(fn: Any, iters: int, repeats: int) -> float:
    """Microseconds per call of ``fn``, ``iters`` calls captured in one CUDA graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def _time_eager(fn: Any, iters: int, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(samples)


def _rank(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    _keep_multicast_off()
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=device)
    group = dist.group.WORLD
    assert group is not None
    dtype = getattr(torch, args.dtype)
    from vllm_actors.kernels.fused_ops import rms_norm
    from vllm_actors.models.fused_all_reduce import FusedAllReduceNorm

    largest = max(args.batches) * args.hidden * torch.finfo(dtype).bits // 8
    fused = FusedAllReduceNorm(group, device, largest)
    flagless = FusedAllReduceNorm(group, device, largest * world, lamport=True)
    iters = args.iters + args.iters % 2  # an even count: a graph's last call and the next replay's first differ in slot
    weight = torch.ones(args.hidden, dtype=dtype, device=device)
    results: list[dict[str, Any]] = []
    for batch in args.batches:
        n = batch * args.hidden
        x = torch.randn(n, dtype=dtype, device=device, generator=torch.Generator(device).manual_seed(rank + 1))
        reference = x.clone()
        dist.all_reduce(reference, group=group)
        row: dict[str, Any] = {"batch": batch, "elements": n, "bytes": n * x.element_size()}
        work = x.clone()
        symm = symm_mem.empty(n, dtype=dtype, device=device)  # a symmetric buffer of this size, on every rank
        symm_mem.rendezvous(symm, group.group_name)

        def nccl(work: torch.Tensor = work) -> None:
            dist.all_reduce(work, group=group)

        def one_shot(x: torch.Tensor = x, symm: torch.Tensor = symm) -> torch.Tensor:
            symm.copy_(x)
            return torch.ops.symm_mem.one_shot_all_reduce(symm, "sum", group.group_name)

        def two_shot(x: torch.Tensor = x, symm: torch.Tensor = symm) -> torch.Tensor:
            symm.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(symm, "sum", group.group_name)
            return symm

        rows = x.view(batch, args.hidden)
        residual = torch.zeros_like(rows)

        def nccl_norm(work: torch.Tensor = work, residual: torch.Tensor = residual) -> torch.Tensor:
            dist.all_reduce(work, group=group)
            return rms_norm(work.view(residual.shape), weight, 1e-6, residual)[1]

        def two_shot_norm(residual: torch.Tensor = residual) -> torch.Tensor:
            return rms_norm(two_shot().view(residual.shape), weight, 1e-6, residual)[1]

        calls = [0]  # consecutive calls of one buffer alternate its slots, as the decoder's call sites do

        def fused_norm(rows: torch.Tensor = rows, residual: torch.Tensor = residual, calls: list[int] = calls
                       ) -> torch.Tensor:
            calls[0] += 1
            return fused(rows, weight, 1e-6, residual, slot=calls[0] % 2)[1]

        lamport_calls = [0]

        def fused_lamport(rows: torch.Tensor = rows, residual: torch.Tensor = residual, calls: list[int] = lamport_calls
                          ) -> torch.Tensor:
            calls[0] += 1
            return flagless(rows, weight, 1e-6, residual, slot=calls[0] % 2)[1]

        checks = {"symm-one-shot": one_shot, "symm-two-shot": two_shot, "fused-norm": fused_norm,
                  "fused-lamport": fused_lamport}
        for name, fn in checks.items():
            try:
                got = fn().clone()
                torch.cuda.synchronize()
                row[f"{name}_max_error"] = float((got.float().reshape(-1) - reference.float()).abs().max())
            except Exception as error:  # an op this build lacks: reported, the others still run
                row[f"{name}_error"] = f"{type(error).__name__}: {error}"
        methods: dict[str, Any] = {"nccl": (_time_graph, nccl), "nccl-eager": (_time_eager, nccl),
                                   "symm-one-shot": (_time_graph, one_shot), "symm-two-shot": (_time_graph, two_shot),
                                   "nccl+norm": (_time_graph, nccl_norm), "two-shot+norm": (_time_graph, two_shot_norm),
                                   "fused-norm": (_time_graph, fused_norm),
                                   "fused-lamport": (_time_graph, fused_lamport)}
        for name, (timer, fn) in methods.items():
            if f"{name}_error" in row:
                continue
            dist.barrier(group=group)
            try:
                row[f"{name}_us"] = timer(fn, iters, args.repeats)
            except Exception as error:
                row[f"{name}_error"] = f"{type(error).__name__}: {error}"
        results.append(row)
        if rank == 0:
            timings = "  ".join(f"{k[:-3]} {v:7.2f} us" for k, v in row.items() if k.endswith("_us"))
            print(f"batch {batch:4d} ({row['bytes'] / 1024:7.1f} KiB): {timings}", flush=True)
    if rank == 0:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps({"world_size": world, "hidden": args.hidden, "dtype": args.dtype,
                                         "iters_per_graph": args.iters, "results": results}, indent=1))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096, help="Qwen3-8B's hidden size")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--world-size", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--iters", type=int, default=50, help="all-reduces per graph")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="results/allreduce.json")
    args = parser.parse_args(argv)
    _keep_multicast_off()
    import torch
    import torch.multiprocessing as mp

    world = args.world_size or torch.cuda.device_count()
    if world < 2:
        print("needs at least 2 GPUs", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="allreduce-") as scratch:
        mp.spawn(_rank, args=(world, f"{scratch}/store", args, args.out), nprocs=world, join=True)
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
