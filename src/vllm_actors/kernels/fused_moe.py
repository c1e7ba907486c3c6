"""The mixture-of-experts MLP: top-k routing and the experts' SwiGLU MLPs (Triton on a GPU, torch elsewhere).

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` computes, for each token ``t``,
``sum_j topk_weights[t, j] * down_e(SiLU(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, j]``;
``w13`` [E, 2I, H] holds each expert's gate rows then its up rows, ``w2`` [E, H, I] its down
projection (a tensor-parallel rank: its slice of every expert's I, the output its partial sum).

The Triton path is vLLM's and SGLang's fused MoE: the T*k (token, choice) pairs are sorted by expert
and each expert's run padded to a multiple of ``BLOCK_M`` (``moe_align_block_size``), so every block
of ``BLOCK_M`` sorted pairs belongs to one expert; a grouped GEMM then runs one program per (block,
column tile) against that expert's weights. Two launches: gate and up in one GEMM with SiLU-and-mul
on its accumulators, then the down GEMM scaled by the routing weight; the k rows of a token are
summed last. Shapes depend on T, k and E only (no host read of the routing): CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_actors.kernels import choice

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with the project
    HAVE_TRITON = False


def use_triton(x: torch.Tensor) -> bool:
    return choice.use_triton("VLLM_ACTORS_FUSED_MOE", HAVE_TRITON, x.device)  # =triton: the interpreter on CPUs


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts (float32), the ``top_k`` largest, renormalised to sum 1 when the
    checkpoint asks (Mixtral always; Qwen3-MoE by ``norm_topk_prob``): (weights float32, ids int64), [T, k]."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


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


# ------------------------------------------------------------------------------------ alignment
def moe_align_block_size(
    topk_ids: torch.Tensor, block_m: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``moe_align_block_size`` in torch ops of static shapes. Returns

    - ``sorted_ids`` [P] int32: indices into the flattened [T*k] (token, choice) pairs, grouped by
      expert in ascending order, each expert's run padded to a multiple of ``block_m`` with T*k;
    - ``block_experts`` [P / block_m] int32: the expert of each block (``num_experts`` past the end);
    - ``num_padded`` [1] int32: the padded length in use (blocks at or past it are skipped).

    P = T*k + E*(block_m - 1), rounded up to ``block_m``: the most any routing can take."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    pairs, device = flat.numel(), flat.device
    capacity = _cdiv(pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # bincount's output size would depend on the ids
    padded_end = torch.cumsum((counts + block_m - 1) // block_m * block_m, 0)
    padded_start = padded_end - (counts + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank_in_expert = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=device)
    sorted_ids[padded_start[experts] + rank_in_expert] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return sorted_ids, block_experts, padded_end[-1:].to(torch.int32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------ kernels
if HAVE_TRITON:

    @triton.jit
    def _block_rows(sorted_ptr, experts_ptr, num_padded_ptr, num_pairs, BLOCK_M: tl.constexpr):
        """This program's block of sorted pairs: (whether it holds any, its expert, pair ids, their mask)."""
        pid_m = tl.program_id(0)
        live = pid_m * BLOCK_M < tl.load(num_padded_ptr)
        expert = tl.load(experts_ptr + pid_m).to(tl.int64)
        pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        return live, expert, pairs, pairs < num_pairs

    @triton.jit
    def _rows_tile(ptr, rows, row_mask, stride, ks, k_mask):
        """[BLOCK_M, BLOCK_K] of the activations: ``rows`` over columns ``ks``."""
        return tl.load(ptr + rows[:, None] * stride + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)

    @triton.jit
    def _expert_dot(acc, a, w_ptr, cols, col_mask, stride_wn, ks, k_mask):
        """acc + a @ w[cols, ks].T for one expert's weight rows ``cols`` (its output features)."""
        w = tl.load(w_ptr + cols[None, :] * stride_wn + ks[:, None], mask=k_mask[:, None] & col_mask[None, :],
                    other=0.0)
        return tl.dot(a, w, acc, input_precision="ieee")

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, w_ptr, weights_ptr, out_ptr, sorted_ptr, experts_ptr, num_padded_ptr,
        N, K, num_pairs, stride_a, stride_we, stride_wn, stride_o,
        GATE_UP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, ACC: tl.constexpr,
    ):  # fmt: skip
        """For this block's pairs: GATE_UP, out[pair, n] = SiLU(a[pair // k] . gate_e[n]) * (a[pair // k] . up_e[n])
        (``w`` holding gate rows then up rows, N each); else out[pair, n] = weight[pair] * (a[pair] . down_e[n])
        (TOP_K 1: ``a`` has a row per pair)."""
        live, expert, pairs, pair_mask = _block_rows(sorted_ptr, experts_ptr, num_padded_ptr, num_pairs, BLOCK_M)
        if live:
            rows = pairs // TOP_K
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            w_base = w_ptr + expert * stride_we
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < K
                a = _rows_tile(a_ptr, rows, pair_mask, stride_a, ks, k_mask)
                acc = _expert_dot(acc, a, w_base, cols, col_mask, stride_wn, ks, k_mask)
                if GATE_UP:
                    acc_up = _expert_dot(acc_up, a, w_base + N * stride_wn, cols, col_mask, stride_wn, ks, k_mask)
            dtype = out_ptr.dtype.element_ty
            if GATE_UP:  # rounded as silu_and_mul rounds the unfused GEMM's output: gate and up to the dtype first
                gate = acc.to(dtype).to(ACC)
                result = (gate / (1.0 + tl.exp(-gate))).to(dtype) * acc_up.to(dtype)
            else:
                result = acc.to(dtype) * tl.load(weights_ptr + pairs, mask=pair_mask, other=0.0).to(dtype)[:, None]
            tl.store(out_ptr + pairs[:, None] * stride_o + cols[None, :], result,
                     mask=pair_mask[:, None] & col_mask[None, :])


def block_m_for(tokens: int, top_k: int, num_experts: int) -> int:
    """Rows of sorted pairs per program: 16 while experts see few tokens each (decode), else 64."""
    return 16 if tokens * top_k <= 4 * num_experts else 64


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    block_m: int | None = None,
) -> torch.Tensor:
    """The grouped-GEMM path (module docstring); ``block_m`` defaults to ``block_m_for``."""
    tokens, hidden = x.shape
    experts, double_inter, _ = w13.shape
    inter, top_k = double_inter // 2, topk_ids.shape[1]
    pairs = tokens * top_k
    block_m = block_m or block_m_for(tokens, top_k, experts)
    sorted_ids, block_experts, num_padded = moe_align_block_size(topk_ids, block_m, experts)
    acc = tl.float64 if x.dtype == torch.float64 else tl.float32
    block_n, block_k = 64, 32
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    activated = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(block_experts.numel(), triton.cdiv(inter, block_n))](
        x, w13, weights, activated, sorted_ids, block_experts, num_padded,
        inter, hidden, pairs, x.stride(0), w13.stride(0), w13.stride(1), activated.stride(0),
        GATE_UP=True, TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ACC=acc,
    )  # fmt: skip
    per_choice = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    _moe_gemm_kernel[(block_experts.numel(), triton.cdiv(hidden, block_n))](
        activated, w2, weights, per_choice, sorted_ids, block_experts, num_padded,
        hidden, inter, pairs, activated.stride(0), w2.stride(0), w2.stride(1), per_choice.stride(0),
        GATE_UP=False, TOP_K=1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, ACC=acc,
    )  # fmt: skip
    return per_choice.view(tokens, top_k, hidden).sum(dim=1)


def fused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; topk_weights, topk_ids [T, k] -> [T, H] (module docstring)."""
    if w13.shape[0] != w2.shape[0] or w13.shape[2] != x.shape[1] or w13.shape[1] != 2 * w2.shape[2]:
        raise ValueError(f"expert weights w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit "
                         f"x {tuple(x.shape)}: need [E, 2I, H] and [E, H, I]")
    if not use_triton(x) or x.shape[0] == 0:
        return fused_moe_torch(x, w13, w2, topk_weights, topk_ids)
    return fused_moe_triton(x, w13, w2, topk_weights, topk_ids)
