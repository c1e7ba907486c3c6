"""The kernel microbenchmark's fused elementwise cases (``benchmarks.lib.kernel_micro``): add + RMSNorm,
SiLU-and-mul and the rotary embedding of q and k, Triton against unfused torch code; and the
sampler's penalties (``kernels/penalties.py``) on min(tokens, 256) rows of Qwen3's vocabulary,
against the torch path the worker used before."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.lib.kernels_timing import DTYPES, do_bench_graph


@dataclass
class FusedRow:
    op: str
    tokens: int
    triton_graph_ms: float
    torch_graph_ms: float
    max_abs_diff: float


Case = tuple[str, Callable[[], Any], Callable[[], Any]]  # name, fused (Triton), eager (torch)


def bench_fused(args: argparse.Namespace, device: torch.device) -> list[FusedRow]:
    """The fused elementwise kernels against unfused torch code at Qwen3-0.6B's sizes (hidden 1024,
    MLP 3072), both timed per call from CUDA graphs."""
    dtype = DTYPES[args.dtype]
    weight, eps = torch.randn(args.hidden_size, device=device, dtype=dtype), 1e-6
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, args.head_dim, 2, device=device).float() / args.head_dim))
    rows: list[FusedRow] = []
    for tokens in args.fused_tokens:
        cases = _cases(args, device, tokens, weight, eps, inv_freq)
        with torch.no_grad():
            for op, fused, eager in cases:
                got, want = fused(), eager()
                got = got[0] if isinstance(got, tuple) else got
                want = want[0] if isinstance(want, tuple) else want
                rows.append(
                    FusedRow(
                        op=op,
                        tokens=tokens,
                        triton_graph_ms=do_bench_graph(fused, args),
                        torch_graph_ms=do_bench_graph(eager, args),
                        max_abs_diff=float((got.float() - want.float()).abs().max()),
                    )
                )
    return rows


def _cases(
    args: argparse.Namespace, device: torch.device, tokens: int, weight: torch.Tensor, eps: float,
    inv_freq: torch.Tensor,
) -> list[Case]:
    """The three cases on ``tokens`` tokens of random inputs (closures over this call's tensors)."""
    from vllm_actors.kernels import fused_ops

    dtype = DTYPES[args.dtype]
    hidden, inter = args.hidden_size, args.intermediate_size
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    r = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gate = torch.randn(tokens, inter, device=device, dtype=dtype)
    up = torch.randn(tokens, inter, device=device, dtype=dtype)
    q = torch.randn(tokens, args.num_heads, args.head_dim, device=device, dtype=dtype)
    k = torch.randn(tokens, args.num_kv_heads, args.head_dim, device=device, dtype=dtype)
    positions = torch.arange(tokens, device=device)

    # the model builds cos/sin once per step for all layers: time only the per-layer part
    angles = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def norm(x: torch.Tensor) -> torch.Tensor:  # the unfused torch RMSNorm
        xf = x.float()
        return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)).to(x.dtype)

    def torch_rotary() -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    half_cos, half_sin = cos[:, : args.head_dim // 2].float(), sin[:, : args.head_dim // 2].float()
    gate_up = torch.cat((gate, up), dim=-1)
    penalise_kernel, penalise_torch = _penalty_case(device, min(tokens, PENALTY_ROWS))
    return [
        ("add+rms_norm", lambda: fused_ops.rms_norm(x, weight, eps, r), lambda: norm(x + r)),
        ("silu_and_mul", lambda: fused_ops.silu_and_mul(gate_up), lambda: F.silu(gate) * up),
        ("rotary_qk", lambda: fused_ops.qk_norm_rope(q.clone(), k.clone(), half_cos, half_sin, None, None, eps),
         torch_rotary),
        ("penalties", penalise_kernel, penalise_torch),
    ]


PENALTY_ROWS, PENALTY_VOCAB = 256, 151936  # a full batch of Qwen3's vocabulary


def _penalty_case(device: torch.device, rows: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The penalties of ``rows`` rows, their pool slots scattered over twice as many: the Triton pass
    and the torch path, each on its own copy of the same logits (in place, as the sampler does)."""
    from vllm_actors.kernels import penalties

    generator = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn((rows, PENALTY_VOCAB), device=device, generator=generator) * 5
    seen = torch.rand((2 * rows, PENALTY_VOCAB), device=device, generator=generator) < 0.01
    counts = (torch.rand((2 * rows, PENALTY_VOCAB), device=device, generator=generator) < 0.005).float() * 2
    index = torch.arange(rows, device=device)
    slots = torch.randperm(2 * rows, device=device, generator=generator)[:rows]
    scalars = torch.tensor([1.1, 0.5, 0.5], device=device).repeat_interleave(rows).view(3, rows)
    mine, theirs = logits.clone(), logits.clone()

    def kernel() -> torch.Tensor:
        penalties.apply_penalties(mine, index, slots, seen, counts, scalars)
        return mine

    def reference() -> torch.Tensor:
        penalties.apply_penalties_torch(theirs, index, slots, seen, counts, scalars)
        return theirs

    return kernel, reference


def format_fused(rows: list[FusedRow]) -> str:
    head = f"{'op':<14}{'tokens':>8}{'triton_graph':>14}{'torch_graph':>13}{'speedup':>9}{'max|diff|':>11}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.op:<14}{r.tokens:>8}{r.triton_graph_ms:>14.4f}{r.torch_graph_ms:>13.4f}"
            f"{r.torch_graph_ms / r.triton_graph_ms:>8.2f}x{r.max_abs_diff:>11.2e}"
        )
    return "\n".join(lines)
