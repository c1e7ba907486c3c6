"""The mixture-of-experts routing kernel (kernels/moe_routing.py) against the torch reference, under
Triton's interpreter on the CPU: softmax, top-k (ties to the lower expert), renormalisation, the
one-launch routing-and-alignment at decode sizes, and the block routing through it."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels import fused_moe, moe_align, moe_routing

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not moe_routing.HAVE_TRITON, reason="needs triton")
# a GPU's exp is approximate (a few ulp) and its tl.dot takes float32 at most
WEIGHT_RTOL = 2e-6 if DEVICE.type == "cpu" else 1e-5
EXACT, TOLERANCE = (torch.float64, 1e-12) if DEVICE.type == "cpu" else (torch.float32, 1e-4)


def _logits(tokens: int, experts: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((tokens, experts), generator=gen, dtype=torch.float64).to(dtype).to(DEVICE)


def _assert_same_routing(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[1].dtype == want[1].dtype == torch.int32 and got[0].dtype == want[0].dtype == torch.float32
    assert torch.equal(got[1], want[1])  # the same experts in the same order
    torch.testing.assert_close(got[0], want[0], rtol=WEIGHT_RTOL, atol=1e-7)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "dtype"), [
    (1, 128, 8, torch.float64), (5, 256, 8, torch.float32), (3, 60, 4, torch.float64),  # E not a power of two
    (2, 8, 2, torch.bfloat16), (4, 3, 3, torch.float32),  # every expert chosen
])  # fmt: skip
@pytest.mark.parametrize("renormalize", [False, True])
def test_kernel_equals_the_reference(tokens: int, experts: int, top_k: int, dtype: torch.dtype,
                                     renormalize: bool) -> None:
    logits = _logits(tokens, experts, seed=experts + top_k, dtype=dtype)
    want = moe_routing.route_torch(logits, top_k, renormalize)
    _assert_same_routing(moe_routing.route_triton(logits, top_k, renormalize), want)
    # the reference's weights against float64 arithmetic on the float32 logits
    probs = torch.softmax(logits.float().double(), -1).gather(-1, want[1].long())
    if renormalize:
        probs = probs / probs.sum(-1, keepdim=True)
    torch.testing.assert_close(want[0].double(), probs, rtol=WEIGHT_RTOL, atol=0)


def test_ties_go_to_the_lower_expert() -> None:
    # bf16 logits tie often: 3.0 four times, the boundary of the top-3 among them; -inf twice past them
    row = [0.5, 3.0, -1.0, 3.0, 3.0, 7.0, 3.0, float("-inf"), 0.5, float("-inf")]
    logits = torch.tensor([row, row[::-1]], dtype=torch.bfloat16, device=DEVICE)
    want = moe_routing.route_torch(logits, 3, True)
    assert want[1].tolist() == [[5, 1, 3], [4, 3, 5]]
    _assert_same_routing(moe_routing.route_triton(logits, 3, True), want)
    everything = moe_routing.route_torch(logits, 10, False)  # the -inf experts last, lower index first
    assert everything[1][0].tolist() == [5, 1, 3, 4, 6, 0, 8, 2, 7, 9]
    _assert_same_routing(moe_routing.route_triton(logits, 10, False), everything)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), [(1, 128, 8, 16), (16, 100, 8, 16),
                                                                      (7, 6, 2, 32)])
def test_one_launch_routes_and_aligns(tokens: int, experts: int, top_k: int, block_m: int) -> None:
    logits = _logits(tokens, experts, seed=tokens, dtype=torch.bfloat16)
    weights, ids, blocks = moe_routing.route_align_triton(logits, top_k, True, block_m)
    _assert_same_routing((weights, ids), moe_routing.route_torch(logits, top_k, True))
    want = moe_align.align_torch(ids, block_m, experts)
    used = int(want.num_blocks)
    assert int(blocks.num_blocks) == used and blocks.block_m == block_m
    assert torch.equal(blocks.sorted_ids, want.sorted_ids)
    for name in ("expert", "start", "end"):  # entries past the used blocks are never read
        assert torch.equal(getattr(blocks, name)[:used], getattr(want, name)[:used]), name


def test_launches_and_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to ROUTE_ALIGN_TOKENS tokens routing and alignment are one launch; above, two (routing, then
    the alignment's one program); a view of the logits with a row stride is read in place (no copy)."""
    monkeypatch.setattr(moe_routing, "ROUTE_ALIGN_TOKENS", 16)  # the one program's bound once measured
    launched: list[str] = []
    for name in ("_route_kernel", "_route_align_kernel"):
        kernel = getattr(moe_routing, name)
        monkeypatch.setattr(moe_routing, name, _Recorder(kernel, name, launched))
    monkeypatch.setattr(moe_align, "_align_kernel", _Recorder(moe_align._align_kernel, "_align_kernel", launched))
    wide = _logits(moe_routing.ROUTE_ALIGN_TOKENS + 1, 16, seed=1, dtype=torch.float32)
    for logits in (wide[:1, :8], wide[:, :8]):
        moe_routing.route_and_align(logits, 2, True, 16)
    assert launched == ["_route_align_kernel", "_route_kernel", "_align_kernel"]
    with pytest.raises(ValueError, match=r"top_k must be between 1 and the number of experts \(8\), got 9"):
        moe_routing.route(wide[:, :8], 9, True)
    with pytest.raises(ValueError, match=r"must be \[tokens, experts\]"):
        moe_routing.route(wide[0], 2, True)


class _Recorder:
    """Stands in for a Triton kernel: records its name at each launch and launches it."""

    def __init__(self, kernel: object, name: str, launched: list[str]) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid: tuple[int]):  # type: ignore[no-untyped-def] # triton's launch syntax
        self.launched.append(self.name)
        return self.kernel[grid]  # type: ignore[index] # a JITFunction


def test_block_routes_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the Triton path the routing gives the blocks to the GEMMs, and the block's output is the torch path's."""
    monkeypatch.setenv("VLLM_ACTORS_FUSED_MOE", "triton")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((3, 32), generator=gen, dtype=torch.float64).to(DEVICE, EXACT)
    w13 = (0.3 * torch.randn((6, 32, 32), generator=gen, dtype=torch.float64)).to(DEVICE, EXACT)
    w2 = (0.3 * torch.randn((6, 32, 16), generator=gen, dtype=torch.float64)).to(DEVICE, EXACT)
    logits = torch.randn((3, 6), generator=gen, dtype=torch.float64).to(DEVICE)
    weights, ids, blocks = fused_moe.route_for_experts(x, w13, logits, 2, False)
    assert blocks is not None and int(blocks.num_blocks) >= 2
    got = fused_moe.fused_moe(x, w13, w2, weights, ids, blocks)
    monkeypatch.setenv("VLLM_ACTORS_FUSED_MOE", "torch")
    weights_t, ids_t, no_blocks = fused_moe.route_for_experts(x, w13, logits, 2, False)
    assert no_blocks is None and torch.equal(ids_t, ids)
    torch.testing.assert_close(weights, weights_t, rtol=WEIGHT_RTOL, atol=1e-7)
    torch.testing.assert_close(got, fused_moe.fused_moe(x, w13, w2, weights, ids), rtol=TOLERANCE, atol=TOLERANCE)
