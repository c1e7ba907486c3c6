"""Top-k routing of a mixture-of-experts layer: the router's logits to each token's k experts and
their weights, in one Triton launch (torch elsewhere: the reference).

Per token: softmax over the E experts in float32; the k experts of the largest logits, in descending
order, equal logits taken lower expert index first (the order of a stable descending sort; the
softmax is monotonic, so these are the k largest probabilities, and choosing on the logits keeps the
choice exact where two probabilities round alike); their probabilities, renormalised to sum 1 where
the checkpoint asks (Qwen3-MoE's ``norm_topk_prob``; Mixtral always, which is its softmax over the k
chosen logits). Outputs: weights [T, k] float32, ids [T, k] int32.

Up to ``ROUTE_ALIGN_TOKENS`` tokens (decode) one program routes every token and then aligns the
(token, choice) pairs into per-expert blocks (``moe_align.align_pairs``): routing and alignment are
one launch. Above it, one program per token routes and the alignment follows as before. Static
shapes, no host read: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from vllm_actors.kernels.moe_align import CHUNK, ONE_PROGRAM_EXPERTS, Alignment, empty_alignment, moe_align_block_size

try:
    import triton
    import triton.language as tl

    from vllm_actors.kernels.moe_align import align_pairs

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False

# Up to this many tokens routing and alignment run in one program. 0 (two launches) until the GPU test of the one
# program (tests/gpu/test_gpu_fused_moe.py, which sets 16) has run: its ids cross threads through a barrier.
ROUTE_ALIGN_TOKENS = 0
MAX_EXPERTS = ONE_PROGRAM_EXPERTS  # the kernel holds a row of every expert in one block
MAX_TOP_K = 16  # the kernel unrolls one max-and-pick per choice


def check_routing(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, experts], got shape {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"top_k must be between 1 and the number of experts ({router_logits.shape[1]}), got {top_k}")


def route_torch(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference (module docstring): (weights float32, ids int32), [T, k]."""
    check_routing(router_logits, top_k)
    logits = router_logits.float()
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.softmax(logits, dim=-1).gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


if HAVE_TRITON:

    @triton.jit
    def _route_rows(logits_ptr, weights_ptr, ids_ptr, rows, T, E, stride_l, BLOCK_T: tl.constexpr,
                    TOP_K: tl.constexpr, K_POW2: tl.constexpr, E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
        """Routes the tokens ``rows`` [BLOCK_T] (those < T): a [BLOCK_T, E] tile of logits, k rounds of
        max-then-lowest-index over the experts not yet chosen."""
        es = tl.arange(0, E_POW2)
        ks = tl.arange(0, K_POW2)
        live = rows < T
        safe_rows = tl.where(live, rows, 0).to(tl.int64)  # rows past T read row 0 and store nothing
        valid = (safe_rows[:, None] >= 0) & (es[None, :] < E)
        logits = tl.load(logits_ptr + safe_rows[:, None] * stride_l + es[None, :], mask=valid,
                         other=float("-inf")).to(tl.float32)
        exps = tl.exp(logits - tl.max(logits, axis=1)[:, None])  # padded experts: 0
        total = tl.sum(exps, axis=1)
        free = valid
        ids = tl.zeros([BLOCK_T, K_POW2], dtype=tl.int32)
        chosen = tl.zeros([BLOCK_T, K_POW2], dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(tl.where(free, logits, float("-inf")), axis=1)
            pick = tl.min(tl.where(free & (logits == best[:, None]), es[None, :], E_POW2), axis=1)
            picked = es[None, :] == pick[:, None]
            slot = ks[None, :] == j
            ids = tl.where(slot, pick[:, None], ids)
            chosen = tl.where(slot, tl.sum(tl.where(picked, exps, 0.0), axis=1)[:, None], chosen)
            free = free & (es[None, :] != pick[:, None])
        if RENORMALIZE:
            weights = chosen / tl.sum(chosen, axis=1)[:, None]
        else:
            weights = chosen / total[:, None]
        out = safe_rows[:, None] * TOP_K + ks[None, :]
        keep = live[:, None] & (ks[None, :] < TOP_K)
        tl.store(ids_ptr + out, ids, mask=keep)
        tl.store(weights_ptr + out, weights, mask=keep)

    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, T, E, stride_l, TOP_K: tl.constexpr,
                      K_POW2: tl.constexpr, E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
        """One program per token."""
        _route_rows(logits_ptr, weights_ptr, ids_ptr, tl.program_id(0) + tl.arange(0, 1), T, E, stride_l, 1, TOP_K,
                    K_POW2, E_POW2, RENORMALIZE)

    @triton.jit
    def _route_align_kernel(logits_ptr, weights_ptr, ids_ptr, sorted_ptr, expert_ptr, start_ptr, end_ptr,
                            num_blocks_ptr, T, E, stride_l, NB, BLOCK_T: tl.constexpr, TOP_K: tl.constexpr,
                            K_POW2: tl.constexpr, E_POW2: tl.constexpr, RENORMALIZE: tl.constexpr,
                            BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
        """One program: every token routed, then its pairs aligned."""
        for t0 in range(0, T, BLOCK_T):
            _route_rows(logits_ptr, weights_ptr, ids_ptr, t0 + tl.arange(0, BLOCK_T), T, E, stride_l, BLOCK_T, TOP_K,
                        K_POW2, E_POW2, RENORMALIZE)
        tl.debug_barrier()  # the ids stored above are read back below by other threads of this one block
        align_pairs(ids_ptr, sorted_ptr, expert_ptr, start_ptr, end_ptr, num_blocks_ptr, T * TOP_K, NB, BLOCK_M,
                    E_POW2, CHUNK)


def _outputs(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, device = router_logits.shape[0], router_logits.device
    return (torch.empty((tokens, top_k), dtype=torch.float32, device=device),
            torch.empty((tokens, top_k), dtype=torch.int32, device=device))


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per token (at most ``MAX_EXPERTS`` experts and ``MAX_TOP_K`` choices)."""
    tokens, experts = router_logits.shape
    weights, ids = _outputs(router_logits, top_k)
    if tokens:
        _route_kernel[(tokens,)](router_logits, weights, ids, tokens, experts, router_logits.stride(0), TOP_K=top_k,
                                 K_POW2=triton.next_power_of_2(top_k), E_POW2=triton.next_power_of_2(experts),
                                 RENORMALIZE=renormalize, num_warps=1 if experts <= 256 else 2)
    return weights, ids


def route_align_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       block_m: int) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """Routing and alignment in one program (for up to ``ROUTE_ALIGN_TOKENS`` tokens)."""
    tokens, experts = router_logits.shape
    weights, ids = _outputs(router_logits, top_k)
    blocks = empty_alignment(tokens * top_k, experts, block_m, router_logits.device)
    _route_align_kernel[(1,)](
        router_logits, weights, ids, blocks.sorted_ids, blocks.expert, blocks.start, blocks.end, blocks.num_blocks,
        tokens, experts, router_logits.stride(0), blocks.expert.numel(),
        BLOCK_T=triton.next_power_of_2(max(1, min(tokens, ROUTE_ALIGN_TOKENS))), TOP_K=top_k,
        K_POW2=triton.next_power_of_2(top_k), E_POW2=triton.next_power_of_2(experts), RENORMALIZE=renormalize,
        BLOCK_M=block_m, CHUNK=CHUNK, num_warps=4,
    )  # fmt: skip
    return weights, ids, blocks


def _row_major(router_logits: torch.Tensor) -> torch.Tensor:
    """The logits as the kernels read them: any row stride, experts adjacent (a copy only otherwise)."""
    return router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()


def _triton_fits(router_logits: torch.Tensor, top_k: int) -> bool:
    return HAVE_TRITON and router_logits.shape[1] <= MAX_EXPERTS and top_k <= MAX_TOP_K


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          use_triton: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``router_logits`` [T, E] -> (weights float32, ids int32), [T, k] (module docstring); the Triton
    kernel when ``use_triton`` and the shape fits it, else the torch reference."""
    check_routing(router_logits, top_k)
    if use_triton and _triton_fits(router_logits, top_k):
        return route_triton(_row_major(router_logits), top_k, renormalize)
    return route_torch(router_logits, top_k, renormalize)


def route_and_align(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, Alignment]:
    """The Triton path's routing and its blocks of ``block_m``: one launch up to ``ROUTE_ALIGN_TOKENS``
    tokens, else the routing kernel then ``moe_align_block_size``."""
    check_routing(router_logits, top_k)
    tokens, experts = router_logits.shape
    if 0 < tokens <= ROUTE_ALIGN_TOKENS and _triton_fits(router_logits, top_k):
        return route_align_triton(_row_major(router_logits), top_k, renormalize, block_m)
    weights, ids = route(router_logits, top_k, renormalize, use_triton=True)
    return weights, ids, moe_align_block_size(ids, block_m, experts, use_triton=True)
