"""The mixture-of-experts MLP: top-k routing and the experts' SwiGLU MLPs (Triton on a GPU, torch elsewhere).

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` computes, for each token ``t``,
``sum_j topk_weights[t, j] * down_e(SiLU(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, j]``;
``w13`` [E, 2I, H] holds each expert's gate rows then its up rows, ``w2`` [E, H, I] its down
projection (a tensor-parallel rank: its slice of every expert's I, the output its partial sum).

The Triton path is vLLM's and SGLang's fused MoE: the T*k (token, choice) pairs are sorted by expert
and cut into blocks of at most ``BLOCK_M`` pairs of one expert (``kernels/moe_align.py``; one launch
at decode); a grouped GEMM then runs one program per (block, column tile) against that expert's
weights, so a step reads each routed expert's weights once and no other expert's. Two GEMM launches:
gate and up in one with SiLU-and-mul on its accumulators, then the down GEMM scaled by the routing
weight; the k rows of a token are summed last. Tiles per batch size: ``kernels/moe_config.py``.
Routing (``kernels/moe_routing.py``): ``route_for_experts`` gives the weights, ids and, on the Triton
path, the blocks, from one launch at decode.
Shapes depend on T, k and E only (no host read of the routing): CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_actors.kernels import choice
from vllm_actors.kernels.moe_align import Alignment, moe_align_block_size
from vllm_actors.kernels.moe_config import GemmTiles, MoeConfig, MoeShape, choose_config
from vllm_actors.kernels.moe_routing import route, route_and_align

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    return choice.use_triton("VLLM_ACTORS_FUSED_MOE", HAVE_TRITON, x.device)  # =triton: the interpreter on CPUs


# ------------------------------------------------------------------------------------ reference
def fused_moe_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """One expert at a time over the tokens routed to it, in ascending expert order, summed as
    transformers sums them (each expert's weighted output added to the token's running sum)."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _fused_moe_torch_dense(x, w13, w2, topk_weights, topk_ids)
    for expert in topk_ids.unique().tolist():
        tokens, slot = torch.where(topk_ids == expert)
        gate_up = F.linear(x[tokens], w13[expert])
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(hidden, w2[expert]) * topk_weights[tokens, slot, None].to(x.dtype)
        out.index_add_(0, tokens, y)
    return out


def _fused_moe_torch_dense(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The reference in static shapes, for CUDA-graph capture (no host sync): every expert over every
    token, weighted by the token's weight for it (0 where unrouted), in ascending expert order."""
    out = torch.zeros_like(x)
    inter = w13.shape[1] // 2
    for expert in range(w13.shape[0]):
        weight = (topk_weights * (topk_ids == expert)).sum(dim=-1, keepdim=True).to(x.dtype)
        gate_up = F.linear(x, w13[expert])
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out += F.linear(hidden, w2[expert]) * weight
    return out


# ------------------------------------------------------------------------------------ kernels
if HAVE_TRITON:

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, expert_ptr, start_ptr, end_ptr, num_blocks_ptr,
        N, K, max_blocks, stride_a, stride_we, stride_wn, stride_o,
        GATE_UP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        """For one block of an expert's pairs and one column tile: GATE_UP, out[pair, n] =
        SiLU(a[pair // k] . gate_e[n]) * (a[pair // k] . up_e[n]) (``w`` holding gate rows then up
        rows, N each); else out[pair, n] = weight[pair] * (a[pair] . down_e[n]) (TOP_K 1: a row per pair).
        Programs run GROUP_M row blocks down a column tile before the next (the weight tile stays in L2)."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(max_blocks - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        if pid_m < tl.load(num_blocks_ptr):
            expert = tl.load(expert_ptr + pid_m).to(tl.int64)
            offs = tl.load(start_ptr + pid_m) + tl.arange(0, BLOCK_M)
            pair_mask = offs < tl.load(end_ptr + pid_m)
            pairs = tl.load(sorted_ptr + offs, mask=pair_mask, other=0).to(tl.int64)  # masked rows: pair 0's row
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            ks = tl.arange(0, BLOCK_K)
            a_ptrs = a_ptr + (pairs // TOP_K)[:, None] * stride_a + ks[None, :]
            # columns past N wrap onto real rows (their results are not stored): the weight loads need no mask
            w_ptrs = w_ptr + expert * stride_we + (cols % N)[None, :] * stride_wn + ks[:, None]
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    w = tl.load(w_ptrs)
                else:
                    k_mask = k0 + ks < K
                    a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
                    w = tl.load(w_ptrs, mask=k_mask[:, None], other=0.0)
                acc = tl.dot(a, w, acc, input_precision="ieee")
                if GATE_UP:
                    if EVEN_K:
                        w_up = tl.load(w_ptrs + N * stride_wn)
                    else:
                        w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None], other=0.0)
                    acc_up = tl.dot(a, w_up, acc_up, input_precision="ieee")
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K
            dtype = out_ptr.dtype.element_ty
            if GATE_UP:  # rounded as silu_and_mul rounds the unfused GEMM's output: gate and up to the dtype first
                gate = acc.to(dtype).to(ACC)
                result = (gate / (1.0 + tl.exp(-gate))).to(dtype) * acc_up.to(dtype)
            else:
                result = acc.to(dtype) * tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0).to(dtype)[:, None]
            tl.store(out_ptr + pairs[:, None] * stride_o + cols[None, :], result,
                     mask=pair_mask[:, None] & (cols < N)[None, :])


def _launch(a: torch.Tensor, w: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, blocks: Alignment,
            tiles: GemmTiles, gate_up: bool, top_k: int) -> None:
    n, k = out.shape[1], a.shape[1]
    nb = blocks.expert.numel()
    acc = tl.float64 if a.dtype == torch.float64 else tl.float32
    _moe_gemm_kernel[(nb * triton.cdiv(n, tiles.block_n),)](
        a, w, weights, out, blocks.sorted_ids, blocks.expert, blocks.start, blocks.end, blocks.num_blocks,
        n, k, nb, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        GATE_UP=gate_up, TOP_K=top_k, BLOCK_M=blocks.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        GROUP_M=tiles.group_m, EVEN_K=k % tiles.block_k == 0, ACC=acc, num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip


def moe_gate_up(x: torch.Tensor, w13: torch.Tensor, blocks: Alignment, top_k: int, tiles: GemmTiles) -> torch.Tensor:
    """SiLU(gate) * up of every pair: [T*k, I] (rows indexed by pair)."""
    activated = torch.empty((blocks.sorted_ids.numel(), w13.shape[1] // 2), dtype=x.dtype, device=x.device)
    _launch(x, w13, activated, activated, blocks, tiles, True, top_k)  # no routing weight: out stands in
    return activated


def moe_down(activated: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, blocks: Alignment,
             tiles: GemmTiles) -> torch.Tensor:
    """Each pair's down projection scaled by its routing weight (``weights`` [T*k] float32): [T*k, H]."""
    per_choice = torch.empty((activated.shape[0], w2.shape[1]), dtype=activated.dtype, device=activated.device)
    _launch(activated, w2, weights, per_choice, blocks, tiles, False, 1)
    return per_choice


def config_for(x: torch.Tensor, w13: torch.Tensor, top_k: int) -> MoeConfig:
    experts, double_inter, hidden = w13.shape
    device = torch.cuda.get_device_name(x.device) if x.is_cuda else x.device.type
    shape = MoeShape(experts, hidden, double_inter // 2, top_k)
    return choose_config(x.shape[0], shape, str(x.dtype).removeprefix("torch."), device, x.element_size())


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    config: MoeConfig | None = None, blocks: Alignment | None = None,
) -> torch.Tensor:
    """The grouped-GEMM path (module docstring); ``config`` defaults to ``moe_config.choose_config``'s;
    ``blocks``: the alignment of ``topk_ids`` made with the routing (``route_for_experts``), if it was."""
    tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    config = config or config_for(x, w13, top_k)
    if blocks is None or blocks.block_m != config.block_m:
        blocks = moe_align_block_size(topk_ids, config.block_m, w13.shape[0], use_triton=True)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    activated = moe_gate_up(x, w13, blocks, top_k, config.gate_up)
    per_choice = moe_down(activated, w2, topk_weights.reshape(-1).float().contiguous(), blocks, config.down)
    return per_choice.view(tokens, top_k, hidden).sum(dim=1)


def route_for_experts(
    x: torch.Tensor, w13: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, Alignment | None]:
    """The routing of ``x``'s tokens (``moe_routing``): (weights, ids, blocks). On the Triton path the
    routing kernel also aligns the pairs for the step's config (one launch at decode); on torch's,
    ``moe_routing.route_torch`` and no blocks."""
    if not use_triton(x) or x.shape[0] == 0:
        return (*route(router_logits, top_k, renormalize), None)
    return route_and_align(router_logits, top_k, renormalize, config_for(x, w13, top_k).block_m)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    blocks: Alignment | None = None,
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights, topk_ids [T, k] -> [T, H] (module docstring);
    ``blocks``: ``route_for_experts``'s alignment, if any."""
    if w13.shape[0] != w2.shape[0] or w13.shape[2] != x.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"x {tuple(x.shape)}: need [E, 2I, H] and [E, H, I]")
    if not use_triton(x) or x.shape[0] == 0:
        return fused_moe_torch(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_triton(x, w13, w2, topk_weights, topk_ids, blocks=blocks)
