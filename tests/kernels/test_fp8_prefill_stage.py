"""The staged fp8 prefill (flash-attn 4 over a bf16 staging of an fp8 context) without flash-attn: the
dequantizing gather against float64, the pieces and their LSE merge against float64 causal attention
over the dequantized cache (a torch model of ``flash_attn_varlen_func`` at the boundary), and the rule
of which steps take it. The real kernel: tests/gpu/test_gpu_fp8_prefill_stage.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from tests.support.fp8_case import make_fp8_case  # noqa: E402
from vllm_actors.kernels import prefill_choice  # noqa: E402
from vllm_actors.kernels.attention import build_attention_metadata, gather_kv  # noqa: E402
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill  # noqa: E402
from vllm_actors.kernels.fp8_prefill_stage import (  # noqa: E402
    Fp8PrefillStaging,
    dequant_gather,
    plan_pieces,
)
from vllm_actors.kernels.triton_attention import TritonPagedAttention  # noqa: E402
from vllm_actors.runner.fp8_staging import attach_fp8_staging, fp8_staging_for, staged_step  # noqa: E402

CPU = torch.device("cpu")
E4M3 = torch.float8_e4m3fn
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def varlen_model(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, softmax_scale: float, causal: bool, return_lse: bool,
                 softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_attn_varlen_func over contiguous K/V, in float64: causal aligned bottom-right; returns the
    output in q's dtype and the natural-log LSE [num_heads, total_q] in float32, as flash-attn 4 does."""
    assert return_lse and cu_seqlens_q.tolist() == [0, q.shape[0]] and cu_seqlens_k.tolist() == [0, k.shape[0]]
    group = q.shape[1] // k.shape[1]
    keys = k.double().repeat_interleave(group, 1).transpose(0, 1)  # [H, n, D]
    values = v.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) * softmax_scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if causal:
        q_pos = torch.arange(q.shape[0]).unsqueeze(1) + (k.shape[0] - q.shape[0])
        scores = scores.masked_fill(torch.arange(k.shape[0]).unsqueeze(0) > q_pos, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, T]
    out = torch.exp(scores - lse.unsqueeze(-1)) @ values
    return out.transpose(0, 1).to(q.dtype), lse.float()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append({name: kwargs[name] for name in ("causal", "softmax_scale")} | {"keys": kwargs["k"].shape[0]})
        return varlen_model(**kwargs)


def staging(recorder: Recorder, dtype: torch.dtype, max_num_tokens: int, stage: int) -> Fp8PrefillStaging:
    return Fp8PrefillStaging(FlashAttnPrefill("flash_attn", recorder), HEADS, KV_HEADS, HEAD_DIM, dtype, CPU,
                             max_num_tokens, stage)


# ----------------------------------------------------------------------------------------------
# The gather
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequant_gather_matches_float64(out_dtype: torch.dtype) -> None:
    """Shuffled blocks of 16, a partial last block, ranges starting and ending mid-block; rows past
    the range keep what they held."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, seq_len = 9, 16, 16 * 6 + 5
    k_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen).mul(20).to(E4M3)
    v_cache = torch.randn(num_blocks, block_size, KV_HEADS, HEAD_DIM, generator=gen).mul(20).to(E4M3)
    table = torch.randperm(num_blocks, generator=gen)[:7].to(torch.int32)
    k_scale, v_scale = torch.tensor([0.0137]), torch.tensor([1.7])
    keys = gather_kv(k_cache, table, seq_len).double() * k_scale.double()
    values = gather_kv(v_cache, table, seq_len).double() * v_scale.double()
    for start, count in ((0, seq_len), (5, 37), (40, seq_len - 40), (21, 1)):
        k_out = torch.full((64 + 64, KV_HEADS, HEAD_DIM), 7.0, dtype=out_dtype)
        v_out = torch.full_like(k_out, 7.0)
        dequant_gather(k_cache, v_cache, table, start, count, k_scale, v_scale, k_out, v_out)
        for out, want in ((k_out, keys), (v_out, values)):
            if out_dtype == torch.float32:  # the product of fp8 and a float32 scale, rounded once
                assert torch.equal(out[:count].double(), want[start : start + count].float().double())
            else:  # the query's dtype, within one of its steps (the interpreter's cast truncates)
                err = (out[:count].double() - want[start : start + count]).abs()
                assert (err <= want[start : start + count].abs() * 2**-7).all()
            assert (out[count:] == 7.0).all()
    with pytest.raises(ValueError, match="cannot take 200 keys"):
        dequant_gather(k_cache, v_cache, table, 0, 200, k_scale, v_scale, k_out, v_out)


# ----------------------------------------------------------------------------------------------
# The pieces and their merge
# ----------------------------------------------------------------------------------------------


def test_plan_pieces() -> None:
    assert plan_pieces(20, 10, 24) == [(0, 20, True)]
    assert plan_pieces(24, 24, 24) == [(0, 24, True)]
    assert plan_pieces(40, 10, 24) == [(0, 16, False), (16, 40, True)]
    assert plan_pieces(70, 10, 24) == [(0, 24, False), (24, 46, False), (46, 70, True)]
    with pytest.raises(ValueError, match="query_len"):
        plan_pieces(70, 25, 24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached,pieces", [(9, 1), (30, 2), (61, 3)])
def test_pieces_merge_to_causal_attention_over_the_dequantized_cache(
    cached: int, pieces: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk of 10 over 9, 30 and 61 cached tokens with a stage of 24: 1, 2 and 3 pieces (boundaries
    mid-block), against float64 attention over fp8 values times non-power-of-two scales."""
    monkeypatch.setitem(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN, HEAD_DIM, 4)
    case = make_fp8_case([(cached, 10)], 16, (HEADS, KV_HEADS), HEAD_DIM, dtype, E4M3, seed=cached,
                         kv_scales=(0.0311, 0.0173))
    recorder = Recorder()
    path = staging(recorder, dtype, 10, 24)
    assert path.wants(case.q, case.k_cache, case.meta)
    out = path(case.q, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale, case.v_scale)
    assert out.dtype == dtype and out.shape == case.q.shape
    assert [call["causal"] for call in recorder.calls] == [False] * (pieces - 1) + [True]
    assert sum(call["keys"] for call in recorder.calls) == cached + 10
    rel = ((out.double() - case.expected).norm() / case.expected.norm()).item()
    assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel


def test_soft_cap_goes_to_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN, HEAD_DIM, 4)
    case = make_fp8_case([(50, 8)], 16, (HEADS, KV_HEADS), HEAD_DIM, torch.float32, E4M3, seed=5)
    path = staging(Recorder(), torch.float32, 8, 20)
    capped = path(case.q, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale, case.v_scale, 0.5)
    once = staging(Recorder(), torch.float32, 8, 64)  # one piece over the whole context: no merge
    want = once(case.q, case.k_cache, case.v_cache, case.meta, case.scale, case.k_scale, case.v_scale, 0.5)
    assert torch.allclose(capped, want, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# Which steps take it
# ----------------------------------------------------------------------------------------------


def test_which_steps_take_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN, HEAD_DIM, 6)
    path = Fp8PrefillStaging(FlashAttnPrefill("auto", Recorder()), HEADS, KV_HEADS, HEAD_DIM, torch.float32, CPU,
                             12, 24)
    assert path.takes_step(1, 6) and path.takes_step(1, 12)
    assert not path.takes_step(1, 5)  # below flash-attn's threshold: Triton
    assert not path.takes_step(2, 12)  # two sequences (or decode rows beside the chunk)
    assert not path.takes_step(1, 1)
    case = make_fp8_case([(30, 8)], 16, (HEADS, KV_HEADS), HEAD_DIM, torch.float32, E4M3, seed=1)
    assert path.wants(case.q, case.k_cache, case.meta)
    assert not path.wants(case.q, case.k_cache.float(), case.meta)  # not an fp8 cache
    assert not path.wants(case.q, case.k_cache, case.meta, sliding_window=16)
    assert not path.wants(case.q.bfloat16(), case.k_cache, case.meta)  # not the staging's dtype
    # a padded graph's metadata (host fields not the step's) never takes it
    padded = build_attention_metadata([8], [8], [list(range(3))], 16)
    padded.max_seq_len = 64
    assert not path.wants(case.q, case.k_cache, padded)
    two = make_fp8_case([(30, 8), (3, 6)], 16, (HEADS, KV_HEADS), HEAD_DIM, torch.float32, E4M3, seed=2)
    assert not path.wants(two.q, two.k_cache, two.meta)
    monkeypatch.setattr(path.prefill, "choice", "triton")
    assert not path.takes_step(1, 12)


def test_the_backend_sends_staged_steps_and_leaves_the_rest_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN, HEAD_DIM, 6)
    recorder = Recorder()
    backend = TritonPagedAttention(prefill=FlashAttnPrefill("auto", recorder))
    backend.staging = Fp8PrefillStaging(backend.prefill, HEADS, KV_HEADS, HEAD_DIM, torch.float32, CPU, 12, 24)
    for specs, staged in (([(40, 8)], True), ([(40, 4)], False), ([(40, 8), (5, 1)], False)):
        case = make_fp8_case(specs, 16, (HEADS, KV_HEADS), HEAD_DIM, torch.float32, E4M3, seed=len(specs))
        before = len(recorder.calls)
        tokens = case.q.shape[0]
        k = torch.zeros(tokens, KV_HEADS, HEAD_DIM)
        out = backend.forward(case.q, k, k, case.k_cache, case.v_cache, case.meta, case.scale, kv_written=True,
                              k_scale=case.k_scale, v_scale=case.v_scale)
        assert (len(recorder.calls) > before) is staged, specs
        rel = ((out.double() - case.expected).norm() / case.expected.norm()).item()
        assert rel < 1e-4, (specs, rel)


def test_the_runner_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """Made (and handed to the backend) only for an fp8 cache, with a flash-attn path whose threshold
    the step budget reaches, a half-precision model and the setting on; staged steps are known."""
    monkeypatch.setitem(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN, HEAD_DIM, 6)
    config = SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)

    def model() -> SimpleNamespace:
        return SimpleNamespace(attn_backend=TritonPagedAttention(prefill=FlashAttnPrefill("auto", Recorder())))

    bf16 = torch.bfloat16
    assert fp8_staging_for(model(), bf16, config, bf16, CPU, 12) is None  # a bf16 cache
    assert fp8_staging_for(model(), E4M3, config, torch.float32, CPU, 12) is None  # flash-attn takes no float32
    assert fp8_staging_for(model(), E4M3, config, bf16, CPU, 5) is None  # chunks never long enough
    assert fp8_staging_for(SimpleNamespace(attn_backend=TritonPagedAttention()), E4M3, config, bf16, CPU, 12) is None
    monkeypatch.setenv("VLLM_ACTORS_FP8_PREFILL_STAGING", "0")
    assert fp8_staging_for(model(), E4M3, config, bf16, CPU, 12) is None
    monkeypatch.delenv("VLLM_ACTORS_FP8_PREFILL_STAGING")
    owner = model()
    made = fp8_staging_for(owner, E4M3, config, bf16, CPU, 12)
    assert made is not None and owner.attn_backend.staging is made
    assert made.stage == 32768 and made.k_stage.shape == (32768, KV_HEADS, HEAD_DIM) and made.k_stage.dtype == bf16
    assert made.nbytes == 2 * 32768 * KV_HEADS * HEAD_DIM * 2 + 12 * HEADS * (HEAD_DIM + 1) * 4
    assert staged_step(owner, [12]) and not staged_step(owner, [5]) and not staged_step(owner, [6, 1])
    assert not staged_step(model(), [12])
    reloaded = model()  # a new model after a level-2 sleep: the same buffers again
    attach_fp8_staging(reloaded, made)
    assert reloaded.attn_backend.staging is made and made.prefill is reloaded.attn_backend.prefill
