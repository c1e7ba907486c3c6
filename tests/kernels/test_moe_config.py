"""The fused MoE kernel's launch parameters per batch size (``kernels/moe_config.py``): every
bucket's built-in config gives the float64 definition on tiny shapes (Triton's interpreter on the
CPU), also under Zipf-skewed routing with empty experts; BLOCK_M is sized for the hot experts; a
tuned JSON table overrides the built-in choice, and a bad table is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_actors.kernels import fused_moe, moe_config
from vllm_actors.kernels.moe_config import GemmTiles, MoeConfig, MoeShape
from vllm_actors.models.router_skew import make_table, parse_skew, skewed_logits

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not fused_moe.HAVE_TRITON, reason="needs triton")
SHAPE = MoeShape(experts=4, hidden=48, intermediate=40, top_k=2)  # not multiples of the tiles: masks matter


def _table(configs: dict[str, object], device: str = "any") -> dict[str, object]:
    shape = {"experts": SHAPE.experts, "hidden": SHAPE.hidden, "intermediate": SHAPE.intermediate,
             "top_k": SHAPE.top_k}
    return {"format": moe_config.FORMAT,
            "tables": [{"shape": shape, "dtype": "float64", "device": device, "configs": configs}]}


@pytest.mark.parametrize("tokens", [1, 8, 40, 100, 600])  # BLOCK_M 16 (decode tiles), 16, 32, 64, 128
def test_each_bucket_matches_the_float64_definition(tokens: int) -> None:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn((tokens, SHAPE.hidden), generator=gen, dtype=torch.float64)
    w13 = 0.3 * torch.randn((SHAPE.experts, 2 * SHAPE.intermediate, SHAPE.hidden), generator=gen, dtype=torch.float64)
    w2 = 0.3 * torch.randn((SHAPE.experts, SHAPE.hidden, SHAPE.intermediate), generator=gen, dtype=torch.float64)
    weights, ids = fused_moe.route(torch.randn((tokens, SHAPE.experts), generator=gen), SHAPE.top_k, True)
    config = moe_config.default_config(tokens, SHAPE, element_bytes=8)
    if DEVICE.type == "cuda":  # a GPU's tl.dot takes float32 at most
        x, w13, w2 = x.float().cuda(), w13.float().cuda(), w2.float().cuda()
        weights, ids = weights.cuda(), ids.cuda()
    got = fused_moe.fused_moe_triton(x, w13, w2, weights, ids, config=config)
    want = fused_moe.fused_moe_torch(x.double(), w13.double(), w2.double(), weights, ids)
    tolerance = 1e-12 if DEVICE.type == "cpu" else 1e-4
    torch.testing.assert_close(got.double(), want, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("tokens", [24, 40, 100])  # BLOCK_M 16, 32, 64 at 16 experts, top-2
def test_skewed_routing_with_empty_experts_matches_the_float64_definition(tokens: int) -> None:
    """Zipf-skewed routing (the benchmarks' router table): the hot experts span several row blocks,
    cold ones none; every bucket's built-in config still gives the float64 definition."""
    shape = MoeShape(experts=16, hidden=48, intermediate=40, top_k=2)
    gen = torch.Generator().manual_seed(tokens)
    table = make_table(parse_skew("zipf:1.2"), shape.experts)
    logits = skewed_logits(table, tokens, 0, torch.float32)
    logits[:, -3:] = -1e4  # the three coldest experts get no token
    weights, ids = fused_moe.route(logits, shape.top_k, True)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=shape.experts)
    config = moe_config.default_config(tokens, shape, element_bytes=8)
    assert int(counts.max()) > config.block_m  # the hottest expert spans row blocks
    x = torch.randn((tokens, shape.hidden), generator=gen, dtype=torch.float64)
    w13 = 0.3 * torch.randn((shape.experts, 2 * shape.intermediate, shape.hidden), generator=gen, dtype=torch.float64)
    w2 = 0.3 * torch.randn((shape.experts, shape.hidden, shape.intermediate), generator=gen, dtype=torch.float64)
    want = fused_moe.fused_moe_torch(x, w13, w2, weights, ids)
    if DEVICE.type == "cuda":
        x, w13, w2, weights, ids = x.float().cuda(), w13.float().cuda(), w2.float().cuda(), weights.cuda(), ids.cuda()
    got = fused_moe.fused_moe_triton(x, w13, w2, weights, ids, config=config)
    tolerance = 1e-12 if DEVICE.type == "cpu" else 1e-4
    torch.testing.assert_close(got.double().cpu(), want, atol=tolerance, rtol=tolerance)


def test_block_m_holds_the_hot_experts_within_the_padding_cap() -> None:
    """Each row block re-reads its expert's weights: BLOCK_M grows with the expected hottest expert
    (HOT_EXPERT_LOAD x the mean rows) past what the mean alone asks, while the mean expert's padding
    stays bounded (4x its rows, at most 64, or 2x)."""
    big = MoeShape(experts=128, hidden=2048, intermediate=768, top_k=8)
    assert moe_config.default_block_m(128, big) > 16  # mean 8 rows, the hottest ~64: more than one 16-row block
    for tokens in (17, 64, 128, 256, 512, 1024, 4096):
        rows = tokens * big.top_k / big.experts
        block_m = moe_config.default_block_m(tokens, big)
        cap = max(16, 2 * rows, min(4 * rows, 64))
        assert block_m <= cap
        hot = min(rows * moe_config.HOT_EXPERT_LOAD, tokens)
        largest = max(m for m in moe_config.BLOCK_MS if m <= cap)
        assert 2 * block_m >= hot or block_m == largest  # two blocks hold the hot expert, or the cap stops it


def test_defaults_follow_the_rows_per_expert_and_fit_shared_memory() -> None:
    big = MoeShape(experts=128, hidden=2048, intermediate=768, top_k=8)
    block_ms = [moe_config.default_config(t, big).block_m for t in (1, 16, 64, 256, 1024, 4096)]
    assert block_ms == sorted(block_ms) and block_ms[0] == 16 and block_ms[-1] >= 64
    for tokens in (1, 16, 256, 4096):
        for element_bytes in (2, 4):
            config = moe_config.default_config(tokens, big, element_bytes)
            limit = moe_config.SHARED_BYTES
            assert moe_config.shared_bytes(config.block_m, config.gate_up, True, element_bytes) <= limit
            assert moe_config.shared_bytes(config.block_m, config.down, False, element_bytes) <= limit


def test_a_tuned_table_overrides_the_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = MoeConfig(32, GemmTiles(16, 32, 2, 2, 2), GemmTiles(64, 16, 1, 4, 1))
    large = MoeConfig(64, GemmTiles(32, 64, 8, 8, 3), GemmTiles(32, 32, 4, 4, 2))
    path = tmp_path / "tuned.json"
    path.write_text(json.dumps(_table({"1": small.to_json(), "64": large.to_json()})))
    assert moe_config.choose_config(3, SHAPE, "float64", "cpu", 8) == moe_config.default_config(3, SHAPE, 8)
    monkeypatch.setenv("VLLM_ACTORS_MOE_CONFIG", str(path))
    assert moe_config.choose_config(1, SHAPE, "float64", "cpu", 8) == small
    assert moe_config.choose_config(7, SHAPE, "float64", "cpu", 8) == small  # log2(7): 2.8 from 1, 3.2 from 64
    assert moe_config.choose_config(9, SHAPE, "float64", "cpu", 8) == large
    assert moe_config.choose_config(5000, SHAPE, "float64", "cpu", 8) == large
    other = MoeShape(8, 48, 40, 2)  # no table: the built-in choice
    assert moe_config.choose_config(1, other, "float64", "cpu", 8) == moe_config.default_config(1, other, 8)
    # and the kernel takes it: the tuned config's output equals the definition
    monkeypatch.setenv("VLLM_ACTORS_FUSED_MOE", "triton")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((2, SHAPE.hidden), generator=gen, dtype=torch.float64)
    w13 = torch.randn((SHAPE.experts, 2 * SHAPE.intermediate, SHAPE.hidden), generator=gen, dtype=torch.float64)
    w2 = torch.randn((SHAPE.experts, SHAPE.hidden, SHAPE.intermediate), generator=gen, dtype=torch.float64)
    weights, ids = fused_moe.route(torch.randn((2, SHAPE.experts), generator=gen), SHAPE.top_k, True)
    if DEVICE.type == "cpu":
        assert fused_moe.config_for(x, w13, SHAPE.top_k) == small
        torch.testing.assert_close(fused_moe.fused_moe(x, w13, w2, weights, ids),
                                   fused_moe.fused_moe_torch(x, w13, w2, weights, ids), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "not JSON"),
    (json.dumps({"tables": []}), "format"),
    (json.dumps(_table({})), "non-empty"),
    (json.dumps(_table({"0": {}})), "token count >= 1"),
    (json.dumps(_table({"1": {"block_m": 16, "gate_up": {"block_n": 32, "block_k": 64}}})), "exactly block_m"),
    (json.dumps(_table({"1": {"block_m": 24, "gate_up": {"block_n": 32, "block_k": 64},
                              "down": {"block_n": 32, "block_k": 64}}})), r"block_m is 24: must be one of"),
    (json.dumps(_table({"1": {"block_m": 16, "gate_up": {"block_n": 48, "block_k": 64},
                              "down": {"block_n": 32, "block_k": 64}}})), r"gate_up.block_n is 48"),
    (json.dumps(_table({"1": {"block_m": 16, "gate_up": {"block_n": 32, "block_k": 64, "num_warps": 4},
                              "down": {"block_n": 32, "block_k": 64}}})), "allowed"),
])
def test_a_bad_table_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str,
                                      message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    monkeypatch.setenv("VLLM_ACTORS_MOE_CONFIG", str(path))
    with pytest.raises(ValueError, match=message) as error:
        moe_config.choose_config(1, SHAPE, "float64", "cpu", 8)
    assert str(path) in str(error.value)


def test_a_missing_file_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_MOE_CONFIG", str(tmp_path / "absent.json"))
    with pytest.raises(ValueError, match="absent.json: cannot read"):
        moe_config.choose_config(1, SHAPE, "float64", "cpu", 8)
