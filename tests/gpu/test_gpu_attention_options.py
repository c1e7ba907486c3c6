"""On a CUDA GPU: sliding windows and soft caps in the Triton varlen and decode kernels (bf16, GQA
32/8, head_dim 128) and in flash-attn 4's prefill where it runs, against the torch reference.

Skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

from tests.support.paged_batch import PagedBatch, paged_batch
from vllm_actors.kernels.attention import TorchPagedAttention
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill, flash_attn_unavailable
from vllm_actors.kernels.triton_attention import paged_attention_decode, paged_attention_varlen

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
OPTIONS = [(4096, None), (512, 50.0), (None, 30.0), (100, None)]


def reference(batch: PagedBatch, window: int | None, cap: float | None) -> torch.Tensor:
    return TorchPagedAttention().forward(
        batch.q.float(), batch.k.float(), batch.v.float(), batch.k_cache.float(), batch.v_cache.float(), batch.meta,
        batch.scale, sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip


def rel(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize(("window", "cap"), OPTIONS)
def test_triton_kernels(window: int | None, cap: float | None) -> None:
    specs = [(0, 1000), (3000, 517), (129, 1), (6000, 300), (16, 16)]
    batch = paged_batch(specs, 16, 32, 8, 128, torch.bfloat16, CUDA, seed=1)
    expected = reference(batch, window, cap)
    batch.write_new_tokens()
    m = batch.meta
    out = paged_attention_varlen(
        batch.q, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, m.max_query_len,
        batch.scale, sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip
    assert rel(out, expected) < 1e-2
    decode = paged_batch([(5000, 1), (40, 1), (9000, 1)], 16, 32, 8, 128, torch.bfloat16, CUDA, seed=2)
    expected = reference(decode, window, cap)
    decode.write_new_tokens()
    d = decode.meta
    out = paged_attention_decode(
        decode.q, decode.k_cache, decode.v_cache, d.query_start_loc, d.seq_lens, d.block_tables, d.max_seq_len,
        decode.scale, sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip
    assert rel(out, expected) < 1e-2


@pytest.mark.skipif(flash_attn_unavailable(CUDA) is not None if torch.cuda.is_available() else True,
                    reason="needs flash-attn 4 on Hopper")
@pytest.mark.parametrize(("window", "cap"), OPTIONS)
def test_flash_attn_prefill(window: int | None, cap: float | None) -> None:
    batch = paged_batch([(0, 1000), (3000, 517), (77, 300)], 16, 32, 8, 128, torch.bfloat16, CUDA, seed=3)
    expected = reference(batch, window, cap)
    batch.write_new_tokens()
    prefill = FlashAttnPrefill("flash_attn")
    assert prefill.wants(batch.q, batch.k_cache, batch.v_cache, batch.meta, window, cap), "flash-attn lacks the options"
    out = prefill(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, window, cap)
    assert rel(out, expected) < 1e-2
