"""The fused mixture-of-experts kernels against torch (float64, Triton's interpreter on the CPU):
the alignment of (token, choice) pairs into per-expert blocks, the grouped GEMMs against a per-token
loop, and the routing's normalisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_actors.kernels import fused_moe, moe_align
from vllm_actors.kernels.moe_config import GemmTiles, MoeConfig

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


@pytest.mark.parametrize("use_triton", [False, True])
def test_align_groups_pairs_by_expert_in_blocks(use_triton: bool) -> None:
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 1]], device=DEVICE)  # expert 1 once, 2 five times
    blocks = moe_align.moe_align_block_size(ids, 4, 5, use_triton=use_triton)
    pairs = ids.numel()
    # the worst case, whatever the routing (e.g. counts 5, 2, 1, 1, 1: 2 + 1 + 1 + 1 + 1 blocks)
    assert blocks.expert.numel() == moe_align.max_blocks(pairs, 5, 4) == 6
    assert int(blocks.num_blocks) == 5  # experts 0, 1, 2 (5 pairs: 2 blocks), 3; expert 4 none
    assert blocks.expert[:5].tolist() == [0, 1, 2, 2, 3]
    assert list(zip(blocks.start[:5].tolist(), blocks.end[:5].tolist(), strict=True)) == [
        (0, 2), (2, 3), (3, 7), (7, 8), (8, 10)]
    flat = ids.reshape(-1)
    assert blocks.sorted_ids.tolist() == torch.argsort(flat.cpu(), stable=True).tolist()  # each expert's in token order
    for b in range(5):
        assert (flat[blocks.sorted_ids[blocks.start[b]:blocks.end[b]].long()] == blocks.expert[b]).all()


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [(1, 128, 8, 16), (9, 6, 3, 16), (70, 16, 2, 32),
                                                                      (40, 300, 4, 64)])
def test_one_program_alignment_equals_the_torch_ops(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    # more pairs than one chunk of the program (70 * 2 = 140 > 64), experts not a power of two
    ids = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)]).to(DEVICE)
    want = moe_align.align_torch(ids, block_m, experts)
    got = moe_align.align_triton(ids, block_m, experts)
    used = int(want.num_blocks)
    assert int(got.num_blocks) == used
    assert torch.equal(got.sorted_ids, want.sorted_ids)
    for name in ("expert", "start", "end"):  # entries past the used blocks are never read
        assert torch.equal(getattr(got, name)[:used], getattr(want, name)[:used]), name


def test_one_token_reads_each_routed_expert_once() -> None:
    """At decode the block table has exactly k blocks, one per routed expert: the grid has no program for an
    unrouted expert and no routed expert is read twice (every column tile of it once)."""
    ids = torch.tensor([[7, 100, 3, 64, 127, 0, 31, 90]], device=DEVICE)
    blocks = moe_align.moe_align_block_size(ids, 16, 128, use_triton=True)
    assert blocks.expert.numel() == int(blocks.num_blocks) == 8
    assert blocks.expert.tolist() == sorted(ids[0].tolist())
    assert ((blocks.end - blocks.start) == 1).all()


def test_decode_alignment_is_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside its one Triton launch the decode alignment runs no torch compute op (each a kernel
    launch on a GPU): only its outputs are allocated."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []
    launches: list[int] = []
    kernel = moe_align._align_kernel

    class Launcher:
        def __getitem__(self, grid: tuple[int]):  # type: ignore[no-untyped-def] # triton's launch syntax
            def launch(*args, **kwargs):  # type: ignore[no-untyped-def] # forwarded as given
                launches.append(len(ops))
                with torch.utils._python_dispatch._disable_current_modes():  # the interpreter's own ops
                    return kernel[grid](*args, **kwargs)
            return launch

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def] # torch's hook
            ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(moe_align, "_align_kernel", Launcher())
    ids = torch.tensor([[5, 1, 2, 7]], device=DEVICE)
    with Record():
        blocks = moe_align.moe_align_block_size(ids, 16, 8, use_triton=True)
    assert len(launches) == 1
    assert [op for op in ops if op.split(".")[-1] not in ("empty", "view", "reshape", "select", "_unsafe_view")] == []
    assert blocks.expert[: int(blocks.num_blocks)].tolist() == [1, 2, 5, 7]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [
    (1, 4, 2, 16),  # one decode token
    (7, 4, 2, 16),  # several tokens per expert, rows masked inside blocks
    (37, 6, 3, 16),  # experts spanning several blocks
    (20, 8, 1, 64),  # top-1, a prefill block size
])
def test_triton_matches_the_definition_in_float64(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    # hidden 40 and intermediate 24 are not multiples of the tiles: the masks and the column wrap matter
    x, w13, w2, weights, ids = _problem(tokens, experts, top_k, 40, 24, seed=tokens)
    want = per_token_moe(x, w13, w2, weights, ids)
    tiles = GemmTiles(32, 16)
    got = fused_moe.fused_moe_triton(x, w13, w2, weights, ids, config=MoeConfig(block_m, tiles, tiles))
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
