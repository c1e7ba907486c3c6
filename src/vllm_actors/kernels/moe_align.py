"""The (token, choice) pairs of a fused MoE step grouped by expert into blocks of ``block_m``
(vLLM's ``moe_align_block_size`` in a compact form, static shapes: CUDA-graph capturable).

``Alignment``: ``sorted_ids`` [P] holds the P = T*k flattened pair indices grouped by expert in
ascending order (each expert's pairs in token order); block ``b`` covers ``sorted_ids[start[b]:
end[b]]`` (at most ``block_m`` pairs, all of expert ``expert[b]``); ``num_blocks`` [1] counts the
blocks in use, and the arrays have ``max_blocks`` entries, the most any routing needs (each used
block holds at least one pair and each expert wastes at most ``block_m - 1`` rows), so a step of one
token has exactly k blocks, one per routed expert, and no program looks at an unrouted one. Padding
is never written: a block's rows past ``end`` are masked in the GEMM.

Up to ``ONE_PROGRAM_PAIRS`` pairs (decode) the whole alignment is one Triton program (one launch);
above it, or without Triton, a dozen torch ops whose cost is small beside the GEMMs of that many rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False

ONE_PROGRAM_PAIRS = 1024  # up to 128 tokens at top-8
ONE_PROGRAM_EXPERTS = 512  # the program holds a vector per expert
CHUNK = 64  # pairs (or blocks) the program handles at a time: [CHUNK, experts] one-hot tiles


class Alignment(NamedTuple):
    sorted_ids: torch.Tensor  # [P] int32
    expert: torch.Tensor  # [max_blocks] int32
    start: torch.Tensor  # [max_blocks] int32, into sorted_ids
    end: torch.Tensor  # [max_blocks] int32
    num_blocks: torch.Tensor  # [1] int32
    block_m: int


def max_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks P pairs can occupy: at most one per pair, and at most ``block_m - 1`` padded
    rows for each of the (at most min(E, P)) experts that got a pair."""
    return max(1, min(pairs, (pairs + min(num_experts, pairs) * (block_m - 1)) // block_m))


def align_torch(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> Alignment:
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount's output size would depend on the ids
    ends = torch.cumsum(counts, 0)
    blocks = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks, 0)
    b = torch.arange(max_blocks(pairs, num_experts, block_m), device=device)
    expert = torch.searchsorted(block_ends, b, right=True).clamp_(max=num_experts - 1)
    start = ends[expert] - counts[expert] + (b - (block_ends[expert] - blocks[expert])) * block_m
    end = torch.minimum(start + block_m, ends[expert])
    return Alignment(torch.argsort(flat, stable=True).to(torch.int32), expert.to(torch.int32),
                     start.to(torch.int32), end.to(torch.int32), block_ends[-1:].to(torch.int32), block_m)


if HAVE_TRITON:

    @triton.jit
    def align_pairs(ids_ptr, sorted_ptr, expert_ptr, start_ptr, end_ptr, num_blocks_ptr, P, NB,
                    BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
        """The whole alignment in the calling program (also called by ``moe_routing``'s fused launch):
        count each expert's pairs, place every pair (stable), write the block table."""
        es = tl.arange(0, E_POW2)
        lanes = tl.arange(0, CHUNK)
        counts = tl.zeros([E_POW2], dtype=tl.int32)
        for c0 in range(0, P, CHUNK):
            ids = tl.load(ids_ptr + c0 + lanes, mask=c0 + lanes < P, other=E_POW2).to(tl.int32)
            counts += tl.sum((ids[:, None] == es[None, :]).to(tl.int32), axis=0)
        ends = tl.cumsum(counts, axis=0)
        starts = ends - counts
        blocks = (counts + BLOCK_M - 1) // BLOCK_M
        block_ends = tl.cumsum(blocks, axis=0)
        block_firsts = block_ends - blocks
        tl.store(num_blocks_ptr, tl.sum(blocks, axis=0))
        placed = tl.zeros([E_POW2], dtype=tl.int32)  # pairs of each expert placed by earlier chunks
        for c0 in range(0, P, CHUNK):
            offs = c0 + lanes
            ids = tl.load(ids_ptr + offs, mask=offs < P, other=E_POW2).to(tl.int32)
            onehot = (ids[:, None] == es[None, :]).to(tl.int32)
            earlier = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)  # same expert, this chunk
            base = tl.sum(onehot * (starts + placed)[None, :], axis=1)
            tl.store(sorted_ptr + base + earlier, offs, mask=offs < P)
            placed += tl.sum(onehot, axis=0)
        for b0 in range(0, NB, CHUNK):
            bs = b0 + lanes
            expert = tl.sum((block_ends[None, :] <= bs[:, None]).to(tl.int32), axis=1)  # searchsorted, right
            expert = tl.minimum(expert, E_POW2 - 1)
            own = (es[None, :] == expert[:, None]).to(tl.int32)
            start = tl.sum(own * starts[None, :], axis=1) + (bs - tl.sum(own * block_firsts[None, :], axis=1)) * BLOCK_M
            end = tl.minimum(start + BLOCK_M, tl.sum(own * ends[None, :], axis=1))
            tl.store(expert_ptr + bs, expert, mask=bs < NB)
            tl.store(start_ptr + bs, start, mask=bs < NB)
            tl.store(end_ptr + bs, end, mask=bs < NB)

    @triton.jit
    def _align_kernel(ids_ptr, sorted_ptr, expert_ptr, start_ptr, end_ptr, num_blocks_ptr, P, NB,
                      BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, CHUNK: tl.constexpr):
        """One program: the alignment of P pairs."""
        align_pairs(ids_ptr, sorted_ptr, expert_ptr, start_ptr, end_ptr, num_blocks_ptr, P, NB, BLOCK_M, E_POW2, CHUNK)


def empty_alignment(pairs: int, num_experts: int, block_m: int, device: torch.device) -> Alignment:
    """The outputs of a one-program alignment of ``pairs`` pairs, unwritten (allocations only)."""
    nb = max_blocks(pairs, num_experts, block_m)
    table = torch.empty((3, nb), dtype=torch.int32, device=device)
    return Alignment(torch.empty(pairs, dtype=torch.int32, device=device), table[0], table[1], table[2],
                     torch.empty(1, dtype=torch.int32, device=device), block_m)


def align_triton(topk_ids: torch.Tensor, block_m: int, num_experts: int) -> Alignment:
    """The one-program form (up to ``ONE_PROGRAM_PAIRS`` pairs and ``ONE_PROGRAM_EXPERTS`` experts)."""
    pairs = topk_ids.numel()
    out = empty_alignment(pairs, num_experts, block_m, topk_ids.device)
    _align_kernel[(1,)](topk_ids.reshape(-1), out.sorted_ids, out.expert, out.start, out.end, out.num_blocks, pairs,
                        out.expert.numel(), BLOCK_M=block_m, E_POW2=triton.next_power_of_2(num_experts), CHUNK=CHUNK,
                        num_warps=4)
    return out


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_experts: int, use_triton: bool) -> Alignment:
    """``topk_ids`` [T, k] -> the blocks (module docstring); one launch at decode when ``use_triton``."""
    if (use_triton and HAVE_TRITON and topk_ids.numel() <= ONE_PROGRAM_PAIRS
            and num_experts <= ONE_PROGRAM_EXPERTS):
        return align_triton(topk_ids.contiguous(), block_m, num_experts)
    return align_torch(topk_ids, block_m, num_experts)
