"""On two GPUs: the fused all-reduce + add + RMSNorm against NCCL's all-reduce then the norm kernel,
with the ranks out of step (one sleeps on the GPU before some calls), call after call through the
three buffer slots, eagerly and replayed from a CUDA graph.

Skipped without two CUDA devices; run on nvidia-h200-x2 by ``benchmarks/gpu_session.sh tp``.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from tests.support.paged_attention_case import captured

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

# (rows, cols, dtype): batch-1 and batched decode at the Qwen3-8B shape, a prefill chunk, a tiny model
SHAPES = [(1, 4096, torch.bfloat16), (64, 4096, torch.bfloat16), (256, 4096, torch.bfloat16),
          (1000, 4096, torch.bfloat16), (3, 64, torch.float32), (200, 64, torch.float32)]


def _rank(rank: int, world: int, store: str) -> None:
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    import torch.distributed as dist

    from vllm_actors.models.fused_all_reduce import FusedAllReduceNorm

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world, device_id=device)
    for lamport in (False, True):
        _calls(FusedAllReduceNorm(dist.group.WORLD, device, 16 << 20, lamport=lamport), rank)
    dist.destroy_process_group()


def _calls(fused: object, rank: int) -> None:
    from vllm_actors.kernels.fused_ops import rms_norm
    from vllm_actors.models.fused_all_reduce import FusedAllReduceNorm

    assert isinstance(fused, FusedAllReduceNorm)
    device = torch.device("cuda", rank)
    generator = torch.Generator(device).manual_seed(1234)  # the same residual and weight on every rank
    for call, (rows, cols, dtype) in enumerate(SHAPES * 4):
        x = torch.randn((rows, cols), device=device, dtype=dtype) * (rank + 1)
        residual = torch.randn((rows, cols), device=device, dtype=dtype, generator=generator)
        weight = 1 + 0.1 * torch.randn(cols, device=device, dtype=dtype, generator=generator)
        if rank == call % 2:
            torch.cuda._sleep(200_000 * (call % 5))  # this rank arrives late, by up to ~0.5 ms
        got = fused(x, weight, 1e-6, residual if call % 3 else None, slot=call % 3)
        want = rms_norm(_nccl_sum(x), weight, 1e-6, residual if call % 3 else None)
        torch.cuda.synchronize()
        assert torch.equal(got[1], want[1]), (call, rows, cols)  # the sum (+ residual): the same bits
        assert float((got[0].float() - want[0].float()).abs().max()) <= 0.02 * float(want[0].float().abs().max())
        _same_on_every_rank(got[1])

    # a decode step's calls captured in a graph: EMBED, then ATTN, MLP per layer, replayed with new inputs
    rows, cols = 4, 4096
    static = torch.zeros((rows, cols), device=device, dtype=torch.bfloat16)
    weight = torch.ones(cols, device=device, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        h, residual = fused(static, weight, 1e-6, None, slot=2)
        for _ in range(8):
            h, residual = fused(h * 0.5, weight, 1e-6, residual, slot=0)
            h, residual = fused(h * 0.25, weight, 1e-6, residual, slot=1)
        return residual

    graph, out = captured(step)
    for replay in range(50):
        static.copy_(torch.randn((rows, cols), device=device, dtype=torch.bfloat16) * (rank + 1))
        want = step()
        if rank == replay % 2:
            torch.cuda._sleep(100_000)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want), replay


def _nccl_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    total = x.clone()
    dist.all_reduce(total)
    return total


def _same_on_every_rank(x: torch.Tensor) -> None:
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    assert all(torch.equal(p, parts[0]) for p in parts)


def test_fused_all_reduce_norm_equals_nccl_then_norm_on_two_gpus() -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fused-ar-") as scratch:
        mp.spawn(_rank, args=(2, f"{scratch}/store"), nprocs=2, join=True)
