"""The batched LoRA kernels (shrink, expand; the per-row pair of small batches) against a
per-token loop in float64 (Triton's interpreter on the CPU): tokens of several adapters and tokens
without one interleaved, slots left empty, one token and many, and the torch path the CPU engine
takes."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.kernels import lora, lora_rows

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not lora.HAVE_TRITON, reason="needs triton")
EXACT, TOLERANCE = (torch.float64, 1e-12) if DEVICE.type == "cpu" else (torch.float32, 1e-4)


def per_token(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The definition, one token at a time."""
    out = y.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] += b[slot] @ (a[slot] @ x[t])
    return out


def _problem(tokens: int, slots: int, rank: int, k: int, n: int, seed: int,
             dtype: torch.dtype = EXACT) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g, dtype=dtype)
    y = torch.randn(tokens, n, generator=g, dtype=dtype)
    a = torch.randn(slots, rank, k, generator=g, dtype=dtype)
    b = torch.randn(slots, n, rank, generator=g, dtype=dtype)
    # slot -1 (no adapter) and every slot but the last (an empty slot), shuffled together
    token_slots = torch.randint(-1, max(slots - 1, 1), (tokens,), generator=g, dtype=torch.int32)
    return tuple(t.to(DEVICE) for t in (x, y, a, b, token_slots))


@pytest.mark.parametrize("tokens, slots, rank, k, n", [
    (1, 1, 16, 64, 96),        # one decode row, one slot
    (7, 4, 48, 80, 72),        # a stacked q/k/v rank (3 x 16), K and N not multiples of the blocks
    (70, 3, 8, 33, 130),       # several token blocks per slot; a rank below the smallest tile
])
def test_shrink_expand_match_per_token(tokens: int, slots: int, rank: int, k: int, n: int, monkeypatch:
                                       pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_LORA_KERNEL", "triton")
    x, y, a, b, token_slots = _problem(tokens, slots, rank, k, n, seed=tokens)
    want = per_token(x, y, a, b, token_slots)
    meta = lora.lora_metadata(token_slots, slots)
    buf = lora.lora_shrink(x, a, meta)
    for t, slot in enumerate(token_slots.tolist()):  # rows of tokens with an adapter
        if slot >= 0:
            torch.testing.assert_close(buf[t], a[slot] @ x[t], atol=TOLERANCE, rtol=TOLERANCE)
    got = y.clone()
    lora.lora_expand(buf, b, got, meta)
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=TOLERANCE)
    untouched = token_slots < 0
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("tokens, slots, rank, k, n", [
    (1, 1, 16, 64, 96),        # one decode row, one slot, one K piece
    (8, 4, 48, 300, 130),      # stacked q/k/v rank (3 x 16), K and N not multiples of the blocks
    (5, 3, 8, 4096, 70),       # rank 8: K in 8 pieces of 512
    (3, 2, 64, 8300, 40),      # more K pieces than MAX_SPLIT: each program walks two
    (2, 2, 100, 700, 50),      # a rank over one rank block: the expand walks two
])
def test_rows_match_per_token(tokens: int, slots: int, rank: int, k: int, n: int) -> None:
    x, y, a, b, token_slots = _problem(tokens, slots, rank, k, n, seed=tokens)
    if tokens > 1:
        token_slots[0], token_slots[1] = 0, -1  # an adapter's row and a row without one, at least
    got = y.clone()
    lora_rows.lora_rows(x, got, a, b, token_slots)
    torch.testing.assert_close(got, per_token(x, y, a, b, token_slots), atol=TOLERANCE, rtol=TOLERANCE)
    untouched = token_slots < 0
    assert torch.equal(got[untouched], y[untouched])


def test_rows_in_bf16_close_to_float64() -> None:
    """bf16 inputs: float32 sums, the rank-r intermediate rounded to bf16 before the expand (as the
    sorted kernels), ``y`` rounded once."""
    x, y, a, b, token_slots = _problem(6, 3, 16, 200, 70, seed=9, dtype=torch.float32)
    x, y, a, b = x.bfloat16(), y.bfloat16(), (0.1 * a).bfloat16(), (0.1 * b).bfloat16()
    token_slots[:2] = torch.tensor([1, -1], dtype=torch.int32)
    got = y.clone()
    lora_rows.lora_rows(x, got, a, b, token_slots)
    want = y.double().clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            want[t] += b[slot].double() @ (a[slot].double() @ x[t].double()).bfloat16().double()
    torch.testing.assert_close(got.double(), want.bfloat16().double(), atol=2e-2, rtol=1e-2)
    assert torch.equal(got[token_slots < 0], y[token_slots < 0])


def test_add_lora_takes_the_row_kernels_up_to_row_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_LORA_KERNEL", "triton")
    taken: list[str] = []
    monkeypatch.setattr(lora, "lora_rows", lambda *args: taken.append("rows"))
    monkeypatch.setattr(lora, "lora_expand", lambda *args: taken.append("sorted"))
    for tokens in (1, lora.ROW_TOKENS, lora.ROW_TOKENS + 1):
        x, y, a, b, token_slots = _problem(tokens, 2, 8, 16, 16, seed=tokens)
        lora.add_lora(x, y, a, b, lora.lora_metadata(token_slots, 2))
    assert taken == ["rows", "rows", "sorted"]


def test_torch_path_matches_per_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_LORA_KERNEL", "torch")
    x, y, a, b, token_slots = _problem(40, 4, 16, 48, 56, seed=3)
    got = y.clone()
    lora.add_lora(x, got, a, b, lora.lora_metadata(token_slots, 4))
    torch.testing.assert_close(got, per_token(x, y, a, b, token_slots), atol=TOLERANCE, rtol=TOLERANCE)


def test_metadata_groups_tokens_by_slot() -> None:
    meta = lora.lora_metadata(torch.tensor([2, -1, 0, 2, 0, -1], dtype=torch.int32), 4)
    assert meta.counts.tolist() == [2, 0, 2, 0]
    assert meta.starts.tolist() == [2, 4, 4, 6]
    assert meta.sorted_tokens.tolist() == [1, 5, 2, 4, 0, 3]
