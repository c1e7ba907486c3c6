"""On a GPU: the benchmarks' skewed router (VLLM_ACTORS_MOE_ROUTER_SKEW) in CUDA graphs. A sparse
block at Qwen3-30B-A3B's router shape (128 experts, top-8) picks the table's top-k, and a graph
captured after a warm-up forward replays what eager runs give; the tiny Qwen3-MoE through the engine
with graphs gives the eager engine's greedy tokens under the skew.

Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from vllm_actors import LLM, SamplingParams
from vllm_actors.models import moe
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.moe import SparseMoeBlock
from vllm_actors.models.router_skew import skewed_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ENV = "VLLM_ACTORS_MOE_ROUTER_SKEW"


def _block(layer: int) -> SparseMoeBlock:
    config = ModelConfig.from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 2048,
        "intermediate_size": 6144, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": True,
    })
    block = SparseMoeBlock(config, layer).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for parameter in block.parameters():
            parameter.normal_(0.0, 0.02)
    return block


@pytest.mark.parametrize("tokens", [1, 64, 512])
def test_the_skewed_block_in_a_cuda_graph(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "zipf:1.2")
    block = _block(layer=5)
    x = torch.randn((tokens, 2048), device="cuda").bfloat16()
    picked: list[torch.Tensor] = []
    fused = moe.fused_moe
    monkeypatch.setattr(moe, "fused_moe", lambda x, w13, w2, weights, ids, *blocks: picked.append(ids) or fused(
        x, w13, w2, weights, ids, *blocks))
    with torch.inference_mode():
        block(x)  # the warm-up builds the table
        logits = skewed_logits(block._skew_table(x.device), tokens, 5, torch.bfloat16).float()
        chosen = logits.gather(1, picked[0].long()).sort(dim=-1, descending=True).values
        assert torch.equal(chosen, torch.topk(logits, 8).values)  # the table's top-8 (ties either way)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = block(x)
        x.copy_(torch.randn((tokens, 2048), device="cuda").bfloat16())
        graph.replay()
        torch.testing.assert_close(captured, block(x), atol=0, rtol=0)


def test_tiny_moe_with_the_skew_greedy_graphs_match_eager(tiny_qwen3_moe: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "zipf:1.2")
    rng = random.Random(6)
    prompts = [[rng.randrange(500) for _ in range(n)] for n in (3, 40, 150)]
    tokens = {}
    # The skewed router routes a token by its row in the step, so one request at a time: a batch of several
    # is laid out differently in eager and graph steps (their rows, hence experts, differ by design).
    for eager in (True, False):
        with LLM(str(tiny_qwen3_moe), executor="inprocess", dtype="float32", enforce_eager=eager, seed=0) as llm:
            tokens[eager] = [llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0.0, max_tokens=16),
                                          use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert tokens[False] == tokens[True]
