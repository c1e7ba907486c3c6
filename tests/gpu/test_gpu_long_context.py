"""On a GPU: cos/sin near position 1,000,000 and the Triton rotary kernel fed with them, against
float64; the long-context engine check (llama3 and yarn rope, chunks, a cached prefix) with CUDA
graphs. Skipped without CUDA; run on the GPU machine by benchmarks/gpu_session.sh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.engine.test_long_context import check_long_context, checkpoint  # noqa: F401 (a fixture)
from vllm_actors.kernels import fused_ops
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.rope import rope_cos_sin, rope_frequencies

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cos_sin_and_the_rotary_kernel_near_one_million(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_FUSED_OPS", "triton")
    config = ModelConfig.from_hf_config({
        "model_type": "llama", "vocab_size": 8, "hidden_size": 256, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
        "max_position_embeddings": 1 << 20, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    })
    freqs = rope_frequencies(config)
    positions = torch.arange(999_000, 1_000_001, 3)
    angles = positions.double().unsqueeze(1) * freqs.inv_freq.unsqueeze(0)  # float64 on the CPU: the reference
    cos, sin = rope_cos_sin(positions.cuda(), freqs.to(torch.device("cuda")))
    assert (cos.cpu().double() - angles.cos()).abs().max() < 1e-6
    assert (sin.cpu().double() - angles.sin()).abs().max() < 1e-6

    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn((len(positions), 4 * 128), generator=generator)
    q, k = qkv[:, :256].view(-1, 2, 128), qkv[:, 256:384].view(-1, 1, 128)
    want_q, want_k = fused_ops.qk_norm_rope_torch(q.double(), k.double(), angles.cos(), angles.sin(), None, None, 0.0)
    gpu = qkv.cuda()
    got_q, got_k = fused_ops.qk_norm_rope(gpu[:, :256].view(-1, 2, 128), gpu[:, 256:384].view(-1, 1, 128),
                                          cos, sin, None, None, 0.0)
    assert (got_q.cpu().double() - want_q).abs().max() < 1e-5
    assert (got_k.cpu().double() - want_k).abs().max() < 1e-5


def test_long_prompt_in_chunks_and_a_cached_prefix_match_transformers_on_the_gpu(checkpoint: Path) -> None:  # noqa: F811
    check_long_context(checkpoint, device="cuda")
