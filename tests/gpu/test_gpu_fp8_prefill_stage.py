"""On a Hopper GPU with flash-attn 4 (``flash_attn.cute``): a long prefill chunk over an fp8 cache through
flash-attn by a bf16 staging of its context (``kernels/fp8_prefill_stage.py``) against float64 attention
over the dequantized cache and against the Triton fp8 path, in 1 to 4 pieces; never under CUDA graph
capture; and in the engine (padded graphs on), whose prompt logprobs agree with the Triton path's.

Skipped elsewhere; run on the GPU machine by ``benchmarks/gpu_session.sh fa4``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.fp8_case import make_fp8_case
from tests.support.paged_batch import shuffled_tables
from vllm_actors.kernels import fp8_prefill_stage, kv_quant
from vllm_actors.kernels.attention import AttentionMetadata, build_attention_metadata
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill, flash_attn_unavailable
from vllm_actors.kernels.fp8_prefill_stage import Fp8PrefillStaging, plan_pieces
from vllm_actors.kernels.triton_attention import paged_attention_varlen

CUDA = torch.device("cuda")
_reason = flash_attn_unavailable(CUDA) if torch.cuda.is_available() else "needs CUDA"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_reason is not None, reason=str(_reason))]
E4M3 = torch.float8_e4m3fn


def triton_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               k_scale: torch.Tensor, v_scale: torch.Tensor) -> torch.Tensor:
    return paged_attention_varlen(q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                  meta.max_query_len, scale, k_scale=k_scale, v_scale=v_scale)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("cached,stage", [(300, 1024), (3000, 1024), (1500, 1024)])
def test_staged_matches_float64_and_the_triton_path(head_dim: int, cached: int, stage: int) -> None:
    """A chunk of 512 over 300, 1500 and 3000 cached tokens with a stage of 1024: 1, 2 and 4 pieces."""
    case = make_fp8_case([(cached, 512)], 16, (16, 4), head_dim, torch.bfloat16, E4M3, seed=cached + head_dim,
                         kv_scales=(0.0311, 0.0173), device=CUDA)
    path = Fp8PrefillStaging(FlashAttnPrefill("flash_attn"), 16, 4, head_dim, torch.bfloat16, CUDA, 512, stage)
    assert path.wants(case.q, case.k_cache, case.meta)
    out = path(case.q, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale, case.v_scale)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel(out.cpu(), case.expected) < 1e-2
    triton = triton_fp8(case.q, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale, case.v_scale)
    assert rel(out, triton) < 1e-2


def test_a_long_chunk_at_the_real_stage() -> None:
    """The Llama-3.2-1B shape (32/8 heads of 64), an 8192-token chunk over 40,000 cached tokens with the
    module's stage (two pieces), against the Triton fp8 path."""
    gen = torch.Generator().manual_seed(0)
    cached, q_len, heads, kv_heads, head_dim = 40000, 8192, 32, 8, 64
    num_blocks, tables = shuffled_tables([(cached, q_len)], 16, gen)
    shape = (num_blocks, 16, kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 30).to(E4M3).to(CUDA)
    v_cache = (torch.randn(shape, generator=gen) * 30).to(E4M3).to(CUDA)
    k_scale, v_scale = kv_quant.kv_scale_tensors(CUDA, 0.05, 0.02)
    q = torch.randn(q_len, heads, head_dim, generator=gen).to(torch.bfloat16).to(CUDA)
    meta = build_attention_metadata([q_len], [cached + q_len], tables, 16, CUDA)
    path = Fp8PrefillStaging(FlashAttnPrefill("auto"), heads, kv_heads, head_dim, torch.bfloat16, CUDA, q_len)
    assert len(plan_pieces(cached + q_len, q_len, path.stage)) == 2
    assert path.wants(q, k_cache, meta)
    out = path(q, k_cache, v_cache, meta, head_dim**-0.5, k_scale, v_scale)
    assert rel(out, triton_fp8(q, k_cache, v_cache, meta, head_dim**-0.5, k_scale, v_scale)) < 1e-2


def test_never_under_capture() -> None:
    case = make_fp8_case([(100, 64)], 16, (16, 4), 64, torch.bfloat16, E4M3, seed=1, device=CUDA)
    path = Fp8PrefillStaging(FlashAttnPrefill("flash_attn"), 16, 4, 64, torch.bfloat16, CUDA, 64, 128)
    assert path.wants(case.q, case.k_cache, case.meta)
    seen: list[bool] = []
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seen.append(path.wants(case.q, case.k_cache, case.meta))
    assert seen == [False]


def test_the_engine_prefills_an_fp8_cache_through_flash_attn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 model, fp8 cache, head_dim 64, 700-token prompts in chunks of 128 over a stage of 256 (up to
    3 pieces), padded graphs on: the staged path ran, and its prompt logprobs are as close to a float32
    engine's over the same fp8 cache (Triton kernels) as the bf16 Triton path's are. (A fixed bound between
    the two bf16 paths measured rounding, not errors: 0.127 at most, 0.024 on average, on the H200.)"""
    from tests.support.prompt_logprobs import prompt_logprobs
    from tests.support.tiny_models import build_checkpoint

    shape = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    path = build_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True, num_shards=1, shape=shape)
    monkeypatch.setattr(fp8_prefill_stage, "STAGE", 256)
    monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", "flash_attn")
    calls: list[int] = []
    original = Fp8PrefillStaging.__call__

    def counted(self: Fp8PrefillStaging, *args: Any) -> torch.Tensor:
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(Fp8PrefillStaging, "__call__", counted)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (700,), generator=gen).tolist() for _ in range(2)]
    monkeypatch.setenv("VLLM_ACTORS_FP8_PREFILL_STAGING", "0")
    monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", "triton")
    reference = prompt_logprobs(path, prompts, dtype="float32", kv_cache_dtype="fp8")
    monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", "flash_attn")
    errors = {}
    for staging in ("1", "0"):
        monkeypatch.setenv("VLLM_ACTORS_FP8_PREFILL_STAGING", staging)
        calls.clear()
        errors[staging] = (prompt_logprobs(path, prompts, kv_cache_dtype="fp8") - reference).abs()
        assert (len(calls) > 0) == (staging == "1"), staging
    staged, triton_ = errors["1"], errors["0"]
    assert staged.max().item() <= 1.5 * triton_.max().item() + 1e-3, (staged.max().item(), triton_.max().item())
    assert staged.mean().item() <= 1.5 * triton_.mean().item() + 1e-4, (staged.mean().item(), triton_.mean().item())
