"""On a GPU: the fused MoE kernel at Qwen3-30B-A3B's expert shapes (E 128, top-8, H 2048, I 768) in
bfloat16 against the torch path in float32, eager and replayed from a CUDA graph; the routing kernel
(with the alignment in its launch at decode sizes) against the torch reference in a graph replay,
on random and on the skewed router's tied bf16 rows; and the tiny MoE models through the engine
with CUDA graphs give the torch path's greedy tokens.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from vllm_actors import LLM, SamplingParams
from vllm_actors.kernels import fused_moe, moe_align, moe_routing
from vllm_actors.models.router_skew import make_table, parse_skew, skewed_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _problem(tokens: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    experts, hidden, inter = 128, 2048, 768
    x = torch.randn((tokens, hidden), generator=gen, device="cuda").bfloat16()
    w13 = (0.02 * torch.randn((experts, 2 * inter, hidden), generator=gen, device="cuda")).bfloat16()
    w2 = (0.02 * torch.randn((experts, hidden, inter), generator=gen, device="cuda")).bfloat16()
    logits = torch.randn((tokens, experts), generator=gen, device="cuda")
    weights, ids = fused_moe.route(logits, 8, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens", [1, 7, 64, 300, 1000, 4096])  # every bucket of moe_config
def test_bf16_kernel_close_to_float32_torch_and_graph_replay(tokens: int) -> None:
    x, w13, w2, weights, ids = _problem(tokens, seed=tokens)
    want = fused_moe.fused_moe_torch(x.float(), w13.float(), w2.float(), weights, ids)
    got = fused_moe.fused_moe_triton(x, w13, w2, weights, ids)
    assert float((got.float() - want).norm() / want.norm()) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # no host read of the routing: capturable
        captured = fused_moe.fused_moe_triton(x, w13, w2, weights, ids)
    new_x, _, _, new_weights, new_ids = _problem(tokens, seed=tokens + 100)
    x.copy_(new_x)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(captured, fused_moe.fused_moe_triton(x, w13, w2, weights, ids), atol=0, rtol=0)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "renormalize"), [
    (1, 128, 8, True), (16, 128, 8, False), (17, 128, 8, True), (4096, 128, 8, True),  # Qwen3-30B-A3B's router
    (3, 8, 2, True), (64, 256, 8, True), (5, 60, 4, False),  # Mixtral's; 256 experts; not a power of two
])  # fmt: skip
def test_routing_kernel_equals_torch_in_a_graph_replay(tokens: int, experts: int, top_k: int, renormalize: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(moe_routing, "ROUTE_ALIGN_TOKENS", 16)  # the one-program path up to 16 tokens, then two
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn((tokens, experts), generator=gen, device="cuda").bfloat16()
    block_m = 16
    moe_routing.route_and_align(logits, top_k, renormalize, block_m)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids, blocks = moe_routing.route_and_align(logits, top_k, renormalize, block_m)
    table = make_table(parse_skew("zipf:1.2"), experts, "cuda")  # bf16 rows: ties at the boundary happen
    for new in (torch.randn((tokens, experts), generator=gen, device="cuda"),
                skewed_logits(table, tokens, 3, torch.bfloat16)):
        logits.copy_(new)
        graph.replay()
        want_weights, want_ids = moe_routing.route_torch(logits, top_k, renormalize)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
        want = moe_align.align_torch(want_ids, block_m, experts)
        used = int(want.num_blocks)
        assert int(blocks.num_blocks) == used
        assert torch.equal(blocks.sorted_ids, want.sorted_ids)
        for name in ("expert", "start", "end"):
            assert torch.equal(getattr(blocks, name)[:used], getattr(want, name)[:used]), name


@pytest.mark.parametrize("checkpoint", ["tiny_qwen3_moe", "tiny_mixtral"])
def test_tiny_moe_greedy_triton_with_graphs_matches_torch(checkpoint: str, request: pytest.FixtureRequest,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    rng = random.Random(5)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (3, 40, 150)]
    tokens = {}
    for choice in ("torch", "triton"):
        monkeypatch.setenv("VLLM_ACTORS_FUSED_MOE", choice)
        with LLM(str(path), executor="inprocess", dtype="float32", max_num_batched_tokens=64, seed=0) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                                   SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
        tokens[choice] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("tokens", [48, 128, 256, 512])  # the built-in BLOCK_M 16, 32, 64, 64: hot experts span blocks
def test_skewed_routing_in_every_block_m_and_a_graph_captured_on_uniform(tokens: int) -> None:
    """zipf:1.2 routing (the hottest expert ~15x its share, cold experts empty) through the built-in and
    the tuned config; a graph captured on uniform routing replays a skewed one (its grid bounds any)."""
    from vllm_actors.kernels import moe_config

    x, w13, w2, weights, ids = _problem(tokens, seed=tokens)
    table = make_table(parse_skew("zipf:1.2"), 128, "cuda")
    skew_weights, skew_ids = fused_moe.route(skewed_logits(table, tokens, 7, torch.bfloat16), 8, renormalize=True)
    want = fused_moe.fused_moe_torch(x.float(), w13.float(), w2.float(), skew_weights, skew_ids)
    shape = moe_config.MoeShape(128, 2048, 768, 8)
    for config in (moe_config.default_config(tokens, shape), fused_moe.config_for(x, w13, 8)):
        got = fused_moe.fused_moe_triton(x, w13, w2, skew_weights, skew_ids, config=config)
        assert float((got.float() - want).norm() / want.norm()) < 2e-2, config
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe.fused_moe_triton(x, w13, w2, weights, ids)
    weights.copy_(skew_weights)
    ids.copy_(skew_ids)
    graph.replay()
    assert float((captured.float() - want).norm() / want.norm()) < 2e-2
