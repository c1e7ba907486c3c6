"""The fused mixture-of-experts kernels against torch (float64, Triton's interpreter on the CPU):
the alignment of (token, choice) pairs into per-expert blocks, the grouped GEMMs against a per-token
loop, and the routing's normalisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_actors.kernels import fused_moe

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fused_moe.HAVE_TRITON, reason="needs triton")
# float64 under the interpreter; a GPU's tl.dot takes float32 at most (then tf32-free "ieee" dots)
EXACT, TOLERANCE = (torch.float64, 1e-12) if DEVICE.type == "cpu" else (torch.float32, 1e-4)


@pytest.fixture(autouse=True)
def _triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_FUSED_MOE", "triton")  # the Triton kernels, also on CPU tensors
    assert fused_moe.use_triton(torch.empty(1, device=DEVICE))


def per_token_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor) -> torch.Tensor:
    """The definition, one token and one choice at a time."""
    inter = w13.shape[1] // 2
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros_like(x[t])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = w13[e] @ x[t]
            total += weights[t, j] * (w2[e] @ (F.silu(gate_up[:inter]) * gate_up[inter:]))
        rows.append(total)
    return torch.stack(rows)


def _problem(tokens: int, experts: int, top_k: int, hidden: int, inter: int, seed: int,
             dtype: torch.dtype = EXACT) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((tokens, hidden), generator=gen, dtype=torch.float64)  # drawn in float64 on every device
    w13 = 0.3 * torch.randn((experts, 2 * inter, hidden), generator=gen, dtype=torch.float64)
    w2 = 0.3 * torch.randn((experts, hidden, inter), generator=gen, dtype=torch.float64)
    logits = torch.randn((tokens, experts), generator=gen, dtype=torch.float64)
    weights, ids = fused_moe.route(logits, top_k, renormalize=True)
    return tuple(t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids))


def test_align_groups_pairs_by_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 1]], device=DEVICE)  # expert 1 once, 2 five times
    sorted_ids, block_experts, num_padded = fused_moe.moe_align_block_size(ids, 4, 5)
    pairs = ids.numel()
    assert sorted_ids.numel() == 4 * fused_moe._cdiv(pairs + 5 * 3, 4)  # the worst case, whatever the routing
    assert int(num_padded) == 4 + 4 + 8 + 4  # experts 0, 1, 2 (5 pairs: 2 blocks), 3; expert 4 none
    flat = ids.reshape(-1)
    used = sorted_ids[: int(num_padded)].view(-1, 4)
    assert block_experts[: used.shape[0]].tolist() == [0, 1, 2, 2, 3]
    assert (block_experts[used.shape[0]:] == 5).all()  # past the end: no expert
    for block, expert in zip(used, block_experts.tolist(), strict=False):
        real = block[block < pairs]
        assert (flat[real.long()] == expert).all()
        assert real.tolist() == sorted(real.tolist())  # stable: each expert's pairs in token order
    assert sorted(sorted_ids[sorted_ids < pairs].tolist()) == list(range(pairs))  # every pair exactly once
    assert (sorted_ids[int(num_padded):] == pairs).all()


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [
    (1, 4, 2, 16),  # one decode token
    (7, 4, 2, 16),  # several tokens per expert, padding inside blocks
    (37, 6, 3, 16),  # experts spanning several blocks
    (20, 8, 1, 64),  # top-1, the prefill block size
])
def test_triton_matches_the_definition_in_float64(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    # hidden 40 and intermediate 24 are not multiples of the 32 x 64 tiles: the masks matter
    x, w13, w2, weights, ids = _problem(tokens, experts, top_k, 40, 24, seed=tokens)
    want = per_token_moe(x, w13, w2, weights, ids)
    got = fused_moe.fused_moe_triton(x, w13, w2, weights, ids, block_m=block_m)
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(fused_moe.fused_moe_torch(x, w13, w2, weights, ids), want, atol=TOLERANCE,
                               rtol=TOLERANCE)
    # the static-shape form the torch path takes under CUDA-graph capture (an expert may get no token)
    torch.testing.assert_close(fused_moe._fused_moe_torch_dense(x, w13, w2, weights, ids), want, atol=TOLERANCE,
                               rtol=TOLERANCE)


def test_dispatch_and_half_precision() -> None:
    x, w13, w2, weights, ids = _problem(9, 4, 2, 32, 16, seed=3, dtype=torch.float16)
    want = fused_moe.fused_moe_torch(x.double(), w13.double(), w2.double(), weights, ids)
    got = fused_moe.fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.float16
    assert float((got.double() - want).norm() / want.norm()) < 1e-2
    with pytest.raises(ValueError, match=r"\[E, 2I, H\] and \[E, H, I\]"):
        fused_moe.fused_moe(x, w13, w2[:, :, :8], weights, ids)


def test_routing_normalisation() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = fused_moe.route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])  # Qwen3-MoE with norm_topk_prob false
    weights, _ = fused_moe.route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(logits[:, [1, 2]], -1))  # Mixtral's: softmax over the top k
