"""Per-layer sliding windows and logit soft-capping: the torch reference against dense float64 math,
the Triton varlen and decode kernels against the reference in float64 (Triton's interpreter on the
CPU), and the flash-attn prefill path handing them to a function that takes them (else Triton)."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tests.support.paged_batch import PagedBatch, flash_attn_varlen_model, paged_batch  # noqa: E402
from vllm_actors.kernels import prefill_choice  # noqa: E402
from vllm_actors.kernels.attention import TorchPagedAttention, gather_kv  # noqa: E402
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill  # noqa: E402
from vllm_actors.kernels.triton_attention import (  # noqa: E402
    TileConfig,
    TritonPagedAttention,
    paged_attention_decode,
    paged_attention_varlen,
)

OPTIONS = [(None, 3.0), (5, None), (7, 2.5), (1, None)]  # (sliding_window, logits_soft_cap)
MIXED = [(0, 13), (9, 6), (20, 1), (3, 0), (30, 9)]  # (cached, new) per sequence


def dense_reference(batch: PagedBatch, window: int | None, cap: float | None) -> torch.Tensor:
    """Each sequence's attention as plain float64 math from its cached context and new tokens."""
    batch.write_new_tokens()
    out = torch.zeros(batch.q.shape, dtype=torch.float64)
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(batch.meta.query_lens_cpu, batch.meta.seq_lens_cpu)):
        keys = gather_kv(batch.k_cache, batch.meta.block_tables[i], seq_len).double().repeat_interleave(group, 1)
        values = gather_kv(batch.v_cache, batch.meta.block_tables[i], seq_len).double().repeat_interleave(group, 1)
        for j in range(q_len):
            pos = seq_len - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,khd->hk", batch.q[start + j].double(), keys[lo : pos + 1]) * batch.scale
            if cap is not None:
                scores = cap * torch.tanh(scores / cap)
            out[start + j] = torch.einsum("hk,khd->hd", torch.softmax(scores, -1), values[lo : pos + 1])
        start += q_len
    return out


@pytest.mark.parametrize(("window", "cap"), OPTIONS)
def test_torch_reference_against_dense_math(window: int | None, cap: float | None) -> None:
    batch = paged_batch(MIXED, 4, 4, 2, 16, torch.float64, seed=1)
    expected = dense_reference(batch, window, cap)
    out = TorchPagedAttention().forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale, kv_written=True,
        sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip
    assert torch.allclose(out, expected, atol=1e-10)
    plain = TorchPagedAttention().forward(
        batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale, kv_written=True
    )
    assert not torch.allclose(plain, expected, atol=1e-3)  # the options change the result


def test_bad_options_are_refused() -> None:
    batch = paged_batch([(0, 2)], 4, 2, 1, 16, torch.float32)
    for kwargs, match in (({"sliding_window": 0}, "sliding_window"), ({"logits_soft_cap": -1.0}, "logits_soft_cap")):
        for call in (
            lambda kw: TorchPagedAttention().forward(
                batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale, **kw
            ),
            lambda kw: paged_attention_varlen(
                batch.q, batch.k_cache, batch.v_cache, batch.meta.query_start_loc, batch.meta.seq_lens,
                batch.meta.block_tables, 2, batch.scale, **kw,
            ),
        ):  # fmt: skip
            with pytest.raises(ValueError, match=match):
                call(kwargs)


def reference(batch: PagedBatch, window: int | None, cap: float | None) -> torch.Tensor:
    return TorchPagedAttention().forward(
        batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), batch.meta, batch.scale,
        sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip


@pytest.mark.parametrize(("window", "cap"), OPTIONS)
def test_varlen_kernel(window: int | None, cap: float | None) -> None:
    """Small tiles (8 rows, 4 keys) so a window starts, ends and cuts across tiles of every kind."""
    batch = paged_batch(MIXED, 4, 4, 2, 16, torch.float64, seed=2)
    expected = reference(batch, window, cap)
    batch.write_new_tokens()
    cfg = TileConfig(block_m=16, block_n=4, num_warps=1, num_stages=1)
    meta = batch.meta
    out = paged_attention_varlen(
        batch.q, batch.k_cache, batch.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.max_query_len, batch.scale, config=cfg, sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip
    rows = torch.tensor(meta.query_lens_cpu).repeat_interleave(torch.tensor(meta.query_lens_cpu)) > 0
    assert torch.allclose(out[rows], expected[rows], atol=1e-5)


@pytest.mark.parametrize(("window", "cap", "splits"), [(5, None, 3), (None, 3.0, 2), (6, 2.0, 4), (40, None, 2)])
def test_decode_kernel(window: int | None, cap: float | None, splits: int) -> None:
    """Splits over the window's tiles only; a window longer than the context changes nothing."""
    batch = paged_batch([(21, 1), (4, 1), (33, 1), (0, 0)], 4, 4, 2, 16, torch.float64, seed=3)
    expected = reference(batch, window, cap)
    batch.write_new_tokens()
    meta = batch.meta
    out = paged_attention_decode(
        batch.q, batch.k_cache, batch.v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        meta.max_seq_len, batch.scale, num_splits=splits, config=TileConfig(16, 4, 1, 1),
        sliding_window=window, logits_soft_cap=cap,
    )  # fmt: skip
    assert torch.allclose(out, expected, atol=1e-5)


class OptionsRecorder:
    """A flash_attn_varlen_func that takes window_size and softcap, as flash-attn 4's does."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(
        self, *, window_size: tuple[int | None, int | None] = (None, None), softcap: float = 0.0, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.calls.append({"window_size": window_size, "softcap": softcap})
        return flash_attn_varlen_model(window_size=window_size, softcap=softcap, **kwargs)


def test_flash_attn_prefill_takes_the_options_or_leaves_them_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN, 32, 2)
    batch = paged_batch([(6, 12), (0, 9)], 16, 4, 2, 32, torch.bfloat16, seed=4)
    expected = reference(batch, 5, 4.0)
    recorder = OptionsRecorder()
    backend = TritonPagedAttention(prefill=FlashAttnPrefill("auto", recorder))
    out = backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), batch.meta, batch.scale,
        sliding_window=5, logits_soft_cap=4.0,
    )  # fmt: skip
    assert recorder.calls == [{"window_size": (4, 0), "softcap": 4.0}]
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2

    def plain(**kwargs: Any) -> tuple[torch.Tensor, None]:  # no window_size/softcap in its signature
        raise AssertionError("a layer with options went to a function that cannot take them")

    backend = TritonPagedAttention(prefill=FlashAttnPrefill("auto", plain))
    out = backend.forward(
        batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), batch.meta, batch.scale,
        sliding_window=5, logits_soft_cap=4.0,
    )  # fmt: skip
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2
    assert math.isfinite(out.float().sum().item())
