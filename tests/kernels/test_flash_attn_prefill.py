"""The flash-attn 4 prefill path without flash-attn: the choice rule, the setting, the arguments the
kernel would receive for a known batch, and the Triton backend handing it the steps it wants (with
a torch model of flash_attn_varlen_func at the boundary). The real kernel: tests/gpu/."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tests.support.paged_batch import VarlenRecorder, paged_batch  # noqa: E402
from vllm_actors.kernels import prefill_choice  # noqa: E402
from vllm_actors.kernels.attention import build_attention_metadata, get_attention_backend  # noqa: E402
from vllm_actors.kernels.flash_attn_prefill import (  # noqa: E402
    FlashAttnPrefill,
    flash_attn_prefill_for,
    flash_attn_unavailable,
    layout_problem,
    pack_gqa_argument,
    varlen_arguments,
)
from vllm_actors.kernels.prefill_choice import min_query_len, prefill_kernel  # noqa: E402
from vllm_actors.kernels.triton_attention import TritonPagedAttention  # noqa: E402

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# The rule and the setting
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128])
def test_auto_takes_flash_attn_from_the_measured_query_length(head_dim: int) -> None:
    threshold = min_query_len(head_dim)
    assert prefill_kernel("auto", True, threshold, head_dim) == "flash_attn"
    assert prefill_kernel("auto", True, threshold - 1, head_dim) == "triton"
    assert prefill_kernel("auto", False, threshold, head_dim) == "triton"  # not installed, not Hopper, fp8 cache
    assert prefill_kernel("triton", True, 1 << 20, head_dim) == "triton"


def test_decode_never_goes_to_flash_attn_and_forcing_takes_every_prefill() -> None:
    for choice in ("auto", "flash_attn"):
        assert prefill_kernel(choice, True, 1, 128) == "triton"
    assert prefill_kernel("flash_attn", True, 2, 128) == "flash_attn"
    assert prefill_kernel("flash_attn", False, 4096, 128) == "triton"  # a layout it cannot take
    # a head_dim that was not measured takes the larger threshold
    assert min_query_len(96) == max(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN.values())
    with pytest.raises(ValueError, match="auto, triton, flash_attn"):
        prefill_kernel("flash", True, 4096, 128)


def test_auto_takes_flash_attn_for_a_short_chunk_over_a_long_context() -> None:
    keys, short = prefill_choice.LONG_CONTEXT_KEYS, prefill_choice.LONG_CONTEXT_MIN_QUERY_LEN
    for head_dim in (64, 128):
        assert prefill_kernel("auto", True, short, head_dim, keys) == "flash_attn"
        assert prefill_kernel("auto", True, short - 1, head_dim, keys) == "triton"
        assert prefill_kernel("auto", True, short, head_dim, keys - 1) == "triton"
        assert prefill_kernel("auto", False, short, head_dim, keys) == "triton"
        assert prefill_kernel("triton", True, short, head_dim, keys) == "triton"
    # beside other sequences (decodes) only at head_dim 128, where it was measured faster
    assert prefill_kernel("auto", True, 1024, 128, keys, num_seqs=64) == "flash_attn"
    assert prefill_kernel("auto", True, 1024, 64, keys, num_seqs=64, other_keys=63 * keys) == "triton"
    # at head_dim 64 where the long query's attention dwarfs the others' keys (weighted): the measured losses
    # (512-1,024 over 16k beside 63 decodes of 16k) stay on Triton, a 1M-token prompt's chunk beside short
    # decodes takes flash-attn 4
    assert prefill_kernel("auto", True, 1024, 64, 16384, num_seqs=64, other_keys=63 * 16384) == "triton"
    assert prefill_kernel("auto", True, 256, 64, 400_000, num_seqs=148, other_keys=147 * 2300) == "flash_attn"
    weight = prefill_choice.MIXED_KEYS_WEIGHT
    pairs = 256 * (keys + 256)
    assert prefill_kernel("auto", True, 256, 64, keys, num_seqs=2, other_keys=pairs // weight) == "flash_attn"
    assert prefill_kernel("auto", True, 256, 64, keys, num_seqs=2, other_keys=pairs // weight + 1) == "triton"


def test_the_context_is_the_longest_querys_and_the_backend_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefill_choice, "LONG_CONTEXT_KEYS", 20)
    monkeypatch.setattr(prefill_choice, "LONG_CONTEXT_MIN_QUERY_LEN", 4)
    prefill = FlashAttnPrefill("auto", VarlenRecorder())
    # (cached, query): the longest query (6) has 24 keys before it, a decode beside it 40
    batch = paged_batch([(40, 1), (24, 6)], 16, 4, 2, 128, torch.bfloat16)
    assert batch.meta.context_of_longest_query() == 24
    assert batch.meta.keys_beside_longest_query() == 41  # the decode's 40 cached keys and its new one
    assert prefill.wants(batch.q, batch.k_cache, batch.v_cache, batch.meta)
    near = paged_batch([(40, 1), (19, 6)], 16, 4, 2, 128, torch.bfloat16)  # 19 keys: under the threshold
    assert near.meta.context_of_longest_query() == 19
    assert not prefill.wants(near.q, near.k_cache, near.v_cache, near.meta)


def test_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ACTORS_PREFILL_ATTENTION", raising=False)
    assert prefill_choice.prefill_choice() == "auto"
    monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", "Flash_Attn")
    assert prefill_choice.prefill_choice() == "flash_attn"
    monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", "fa4")
    with pytest.raises(ValueError, match="VLLM_ACTORS_PREFILL_ATTENTION must be one of auto, triton, flash_attn"):
        prefill_choice.prefill_choice()


def test_off_the_gpu_auto_keeps_triton_and_forcing_flash_attn_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "not a CUDA GPU" in str(flash_attn_unavailable(CPU))
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    for choice in ("auto", "triton"):
        monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", choice)
        assert flash_attn_prefill_for(CPU) is None
        backend = get_attention_backend(CPU)
        assert isinstance(backend, TritonPagedAttention) and backend.prefill is None
    monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", "flash_attn")
    with pytest.raises(ValueError, match="needs flash-attn 4 .* on a Hopper GPU: the device is cpu"):
        get_attention_backend(CPU)


def test_layouts_flash_attn_cannot_take() -> None:
    q = torch.zeros(3, 8, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16)
    assert layout_problem(q, cache, cache) is None
    assert "float16 or bfloat16" in str(layout_problem(q.float(), cache.float(), cache.float()))
    fp8 = cache.to(torch.float8_e4m3fn)
    assert "float8_e4m3fn" in str(layout_problem(q, fp8, fp8))  # an fp8 cache stays on Triton (SM90)
    odd = torch.zeros(4, 16, 2, 24, dtype=torch.bfloat16)
    assert "multiple of 16" in str(layout_problem(q[..., :24], odd, odd))
    assert "multiple of num_kv_heads" in str(layout_problem(q[:, :7], cache, cache))


# ----------------------------------------------------------------------------------------------
# The arguments at the boundary
# ----------------------------------------------------------------------------------------------


def test_arguments_of_a_known_batch() -> None:
    """A fresh prompt, a chunk over a cached prefix and a decode row: the engine's metadata goes
    through as it is (query starts, context lengths, block tables as the page table)."""
    tables = [[3], [5, 0, 7], [2]]
    meta = build_attention_metadata([5, 3, 1], [5, 35, 8], tables, 16)
    q = torch.zeros(9, 4, 32, dtype=torch.bfloat16)
    cache = torch.zeros(8, 16, 2, 32, dtype=torch.bfloat16)
    args = varlen_arguments(q, cache, cache, meta, 0.125)
    assert args["q"] is q and args["k"] is cache and args["v"] is cache
    assert args["cu_seqlens_q"].tolist() == [0, 5, 8, 9]
    assert args["seqused_k"].tolist() == [5, 35, 8]
    assert args["page_table"].tolist() == [[3, 0, 0], [5, 0, 7], [2, 0, 0]]
    for name in ("cu_seqlens_q", "seqused_k", "page_table"):
        assert args[name].dtype == torch.int32 and args[name].is_contiguous(), name
    assert args["page_table"] is meta.block_tables  # no copy when the metadata already suits
    assert args["softmax_scale"] == 0.125 and args["causal"] is True
    assert "max_seqlen_q" not in args  # one compiled variant for every batch
    # int64 metadata, or a block table sliced from a wider one, is made int32 and contiguous
    wide = torch.arange(30, dtype=torch.int64).reshape(3, 10)
    meta.block_tables, meta.query_start_loc = wide[:, :3], meta.query_start_loc.long()
    args = varlen_arguments(q, cache, cache, meta, 0.125)
    assert args["page_table"].tolist() == wide[:, :3].tolist() and args["page_table"].is_contiguous()
    assert args["cu_seqlens_q"].dtype == torch.int32


@pytest.mark.parametrize(("setting", "passed"), [(None, None), ("auto", None), ("on", True), ("off", False)])
def test_pack_gqa_follows_the_setting(monkeypatch: pytest.MonkeyPatch, setting: str | None,
                                      passed: bool | None) -> None:
    """``VLLM_ACTORS_FLASH_ATTN_PACK_GQA``: auto (or unset) leaves flash-attn its own choice (no argument),
    on and off pass it; heads that are not grouped never get it; the answer is the reference's either way."""
    if setting is None:
        monkeypatch.delenv("VLLM_ACTORS_FLASH_ATTN_PACK_GQA", raising=False)
    else:
        monkeypatch.setenv("VLLM_ACTORS_FLASH_ATTN_PACK_GQA", setting)
    recorder = VarlenRecorder()
    prefill = FlashAttnPrefill("flash_attn", recorder)
    batch = paged_batch([(0, 9), (20, 12)], 16, 4, 2, 32, torch.bfloat16, seed=5)
    expected = batch.reference()
    batch.write_new_tokens()
    out = prefill(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert recorder.calls[-1].get("pack_gqa") is passed
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2
    assert pack_gqa_argument("on", 4, 4) is None and pack_gqa_argument("off", 4, 4) is None
    with pytest.raises(ValueError, match="pack_gqa must be one of auto, on, off"):
        FlashAttnPrefill("flash_attn", recorder, pack_gqa="yes")


def test_the_backend_hands_flash_attn_the_steps_it_wants(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill over cached prefixes beside a decode row, GQA 4/2: above the threshold the
    step goes to flash-attn (arguments as the model of its semantics reads them give the torch
    reference's output), below it and for decode steps the Triton kernels answer."""
    monkeypatch.setitem(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN, 32, 9)
    recorder = VarlenRecorder()
    backend = TritonPagedAttention(prefill=FlashAttnPrefill("auto", recorder))
    cases = {
        "long": ([(0, 9), (20, 12), (16, 1)], 1),  # longest query 12 >= 9: flash-attn
        "short": ([(3, 5), (17, 8)], 0),  # 8 < 9: the varlen kernel
        "decode": ([(5, 1), (30, 1)], 0),
    }
    for name, (specs, calls) in cases.items():
        batch = paged_batch(specs, 16, 4, 2, 32, torch.bfloat16, seed=len(specs))
        expected = batch.reference()
        before = len(recorder.calls)
        out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
        assert len(recorder.calls) - before == calls, name
        rel = ((out.float() - expected).norm() / expected.norm()).item()
        assert rel < 1e-2, (name, rel)
    assert recorder.calls[0]["seqused_k"].tolist() == [9, 32, 17]


def test_an_fp8_cache_or_float32_stays_on_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(prefill_choice.FLASH_ATTN_MIN_QUERY_LEN, 32, 2)
    prefill = FlashAttnPrefill("flash_attn", VarlenRecorder())
    batch = paged_batch([(4, 6)], 16, 4, 2, 32, torch.bfloat16)
    assert prefill.wants(batch.q, batch.k_cache, batch.v_cache, batch.meta)
    fp8 = batch.k_cache.to(torch.float8_e4m3fn)
    assert not prefill.wants(batch.q, fp8, fp8, batch.meta)
    assert not prefill.wants(batch.q.float(), batch.k_cache.float(), batch.v_cache.float(), batch.meta)
