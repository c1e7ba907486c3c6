"""On a Hopper GPU with flash-attn 4 (``flash_attn.cute``): the flash-attn prefill path against the
torch reference for chunked prefill over cached prefixes, GQA 32/8, head_dim 64 and 128, pages of
16 (cp.async loads) and 128 tokens (TMA loads), query heads packed per KV head or not, also replayed
from a CUDA graph.

Skipped elsewhere; run on the GPU machine by ``benchmarks/gpu_session.sh fa4``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.paged_batch import PagedBatch, paged_batch
from vllm_actors.kernels.attention import AttentionMetadata, get_attention_backend
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill, flash_attn_unavailable, varlen_arguments
from vllm_actors.kernels.flash_attn_replay import FlashAttnReplay
from vllm_actors.kernels.prefill_choice import min_query_len
from vllm_actors.kernels.triton_attention import TritonPagedAttention, paged_attention_varlen

CUDA = torch.device("cuda")
_reason = flash_attn_unavailable(CUDA) if torch.cuda.is_available() else "needs CUDA"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_reason is not None, reason=str(_reason))]

# fresh prompts, chunks over cached prefixes (block-aligned and not), a decode row mixed in
SPECS = [(0, 1000), (3000, 517), (129, 1), (4096, 2048), (77, 300), (16, 16)]
HEADS, KV_HEADS = 32, 8


def assert_matches(out: torch.Tensor, expected: torch.Tensor, meta: AttentionMetadata, tol: float = 1e-2) -> None:
    assert torch.isfinite(out).all()
    start = 0
    for i, q_len in enumerate(meta.query_lens_cpu):
        part, ref = out[start : start + q_len].float(), expected[start : start + q_len]
        rel = ((part - ref).norm() / ref.norm()).item()
        assert rel < tol, f"sequence {i} (query {q_len}, context {meta.seq_lens_cpu[i]}): rel err {rel:.2e}"
        start += q_len


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flash_attn_prefill_matches_the_reference(head_dim: int, block_size: int) -> None:
    batch = paged_batch(SPECS, block_size, HEADS, KV_HEADS, head_dim, torch.bfloat16, CUDA, seed=head_dim + block_size)
    expected = batch.reference()
    batch.write_new_tokens()
    out = FlashAttnPrefill("flash_attn")(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    assert_matches(out, expected, batch.meta)
    m = batch.meta
    triton_out = paged_attention_varlen(
        batch.q, batch.k_cache, batch.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, m.max_query_len,
        batch.scale,
    )  # fmt: skip
    assert_matches(out, triton_out.float(), m)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_chunk_split_over_its_keys_matches_the_reference(head_dim: int, block_size: int) -> None:
    """A 256-token chunk over 100k keys (64 CTAs unsplit) beside decodes: split over its keys
    (``flash_attn_split``, the real kernel's lse and non-causal variants) it matches the torch
    reference and Triton, and so does the one call it replaces."""
    specs = [(100_000 + 5, 256)] + [(2000 + 37 * i, 1) for i in range(12)]
    batch = paged_batch(specs, block_size, HEADS, KV_HEADS, head_dim, torch.bfloat16, CUDA, seed=11 + block_size)
    expected = batch.reference()
    batch.write_new_tokens()
    split = FlashAttnPrefill("flash_attn", split_keys=True)
    assert split.splits(batch.q, batch.k_cache, batch.meta) is not None
    out = split(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_matches(out, expected, batch.meta)
    whole = FlashAttnPrefill("flash_attn", split_keys=False)(batch.q, batch.k_cache, batch.v_cache, batch.meta,
                                                            batch.scale)
    assert_matches(out, whole.float(), batch.meta)


def test_replayed_calls_equal_flash_attns_own() -> None:
    """``flash_attn_replay``: once two sizes confirmed a kind, its calls go straight to the compiled kernel
    and give flash_attn_varlen_func's output and LSE bit for bit, at other sizes too."""
    import flash_attn.cute.interface as interface
    from flash_attn.cute import flash_attn_varlen_func

    replay = FlashAttnReplay(flash_attn_varlen_func, interface)
    sizes = ([(3000, 517), (129, 1)], [(0, 1000)], [(4096, 200), (77, 1), (5, 1)], [(16, 16)], [(20_000, 64)])
    for seed, specs in enumerate(sizes):
        batch = paged_batch(specs, 16, HEADS, KV_HEADS, 64, torch.bfloat16, CUDA, seed=seed)
        batch.write_new_tokens()
        arguments = {**varlen_arguments(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale),
                     "return_lse": True}
        out, lse = replay(**arguments)
        want, want_lse = flash_attn_varlen_func(**arguments)
        assert torch.equal(out, want) and lse is not None and torch.equal(lse, want_lse)
    assert [found is not None for found in replay.replays.values()] == [True]


@pytest.mark.parametrize("block_size", [16, 128])
def test_unpacked_query_heads_match_the_reference(block_size: int) -> None:
    """``VLLM_ACTORS_FLASH_ATTN_PACK_GQA=off``: one query head a tile, over pages loaded by cp.async and by TMA."""
    batch = paged_batch(SPECS, block_size, HEADS, KV_HEADS, 128, torch.bfloat16, CUDA, seed=7 + block_size)
    expected = batch.reference()
    batch.write_new_tokens()
    out = FlashAttnPrefill("flash_attn", pack_gqa="off")(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
    assert_matches(out, expected, batch.meta)


def test_the_backend_sends_long_chunks_to_flash_attn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forced and auto: the backend built for the GPU writes the cache and attends through flash-attn
    (the varlen kernel is never called), strided q (a view of a fused qkv projection) included;
    decode steps stay on Triton."""
    import vllm_actors.kernels.triton_attention as triton_attention

    def no_varlen(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Triton varlen kernel ran")

    monkeypatch.setattr(triton_attention, "paged_attention_varlen", no_varlen)
    for choice in ("flash_attn", "auto"):
        monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", choice)
        backend = get_attention_backend(CUDA)
        assert isinstance(backend, TritonPagedAttention) and backend.prefill is not None
        batch = paged_batch([(500, min_query_len(128)), (40, 3)], 16, HEADS, KV_HEADS, 128, torch.bfloat16, CUDA)
        wide = torch.zeros(batch.q.shape[0], HEADS + 2 * KV_HEADS, 128, dtype=batch.q.dtype, device=CUDA)
        wide[:, :HEADS] = batch.q
        batch.q = wide[:, :HEADS]
        expected = batch.reference()
        out = backend.forward(batch.q, batch.k, batch.v, batch.k_cache, batch.v_cache, batch.meta, batch.scale)
        assert_matches(out, expected, batch.meta)
        decode = paged_batch([(700, 1), (3, 1)], 16, HEADS, KV_HEADS, 128, torch.bfloat16, CUDA)
        assert not backend.prefill.wants(decode.q, decode.k_cache, decode.v_cache, decode.meta)


def _padded(batch: PagedBatch, tokens: int, seqs: int, width: int) -> dict[str, torch.Tensor]:
    """The step's inputs padded as the engine's padded graphs pad them: rows past the step's tokens
    in no sequence, sequences past its own with no query and no context."""
    m = batch.meta
    num_tokens, num_seqs = batch.q.shape[0], m.num_seqs
    q = torch.zeros(tokens, *batch.q.shape[1:], dtype=batch.q.dtype, device=CUDA)
    q[:num_tokens] = batch.q
    starts = torch.full((seqs + 1,), num_tokens, dtype=torch.int32, device=CUDA)
    starts[: num_seqs + 1] = m.query_start_loc
    lens = torch.zeros(seqs, dtype=torch.int32, device=CUDA)
    lens[:num_seqs] = m.seq_lens
    tables = torch.zeros(seqs, width, dtype=torch.int32, device=CUDA)
    tables[:num_seqs, : m.block_tables.shape[1]] = m.block_tables
    return {"q": q, "query_start_loc": starts, "seq_lens": lens, "block_tables": tables}


def test_flash_attn_prefill_replays_from_a_cuda_graph() -> None:
    """Captured once for a padded step of 4096 rows and 8 sequences, replayed for two other steps."""
    tokens, seqs, block_size = 4096, 8, 16
    first = paged_batch([(0, 4000)], block_size, HEADS, KV_HEADS, 64, torch.bfloat16, CUDA, seed=1)
    later = [[(3000, 517), (0, 1200), (129, 1), (60, 2000)], [(8000, 4096)]]
    width = max(-(-sum(spec) // block_size) for specs in later for spec in specs)
    static = _padded(first, tokens, seqs, width)
    prefill = FlashAttnPrefill("flash_attn")

    def meta() -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=CUDA),
            query_start_loc=static["query_start_loc"], seq_lens=static["seq_lens"],
            block_tables=static["block_tables"], max_query_len=tokens, max_seq_len=width * block_size,
            query_lens_cpu=[tokens] + [0] * (seqs - 1), seq_lens_cpu=[tokens] + [0] * (seqs - 1),
        )  # fmt: skip

    caches: list[PagedBatch] = []
    for index, specs in enumerate(later):
        batch = paged_batch(specs, block_size, HEADS, KV_HEADS, 64, torch.bfloat16, CUDA, seed=10 + index)
        batch.write_new_tokens()
        caches.append(batch)
    # one pool for every step: the later batches' caches side by side, tables shifted into it
    k_pool = torch.cat([b.k_cache for b in caches])
    v_pool = torch.cat([b.v_cache for b in caches])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the graph
            prefill(static["q"], k_pool, v_pool, meta(), first.scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prefill(static["q"], k_pool, v_pool, meta(), first.scale)
    offset = 0
    for batch in caches:
        expected = batch.reference()
        batch.meta.block_tables = batch.meta.block_tables + offset
        for name, value in _padded(batch, tokens, seqs, width).items():
            static[name].copy_(value)
        graph.replay()
        assert_matches(out[: batch.q.shape[0]], expected, batch.meta)
        offset += batch.k_cache.shape[0]


def test_the_engine_prefills_through_flash_attn(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 engine, head_dim 64, chunked prefill of 700-token prompts (each chunk over the ones cached
    before it), CUDA graphs of the padded steps: prompt logprobs through flash-attn are as close to a
    float32 engine's (Triton kernels) as the bf16 Triton kernels' are, and flash-attn really ran. (A fixed
    bound between the two bf16 paths measured rounding, not errors: 0.127 at most on the H200.)"""
    from tests.support.prompt_logprobs import prompt_logprobs
    from tests.support.tiny_models import build_checkpoint
    from vllm_actors.kernels import flash_attn_prefill

    shape = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    path = build_checkpoint(tmp_path, "qwen3", tie_word_embeddings=True, num_shards=1, shape=shape)
    calls = []
    original = flash_attn_prefill.FlashAttnPrefill.__call__

    def counted(self: FlashAttnPrefill, *args: Any) -> torch.Tensor:
        calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(flash_attn_prefill.FlashAttnPrefill, "__call__", counted)
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(0, 500, (700,), generator=gen).tolist()
    prompts = [base, base[:600] + torch.randint(0, 500, (90,), generator=gen).tolist()]
    monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", "triton")
    reference = prompt_logprobs(path, prompts, dtype="float32")
    errors = {}
    for choice in ("triton", "flash_attn"):
        monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", choice)
        calls.clear()
        errors[choice] = (prompt_logprobs(path, prompts) - reference).abs()
        assert (len(calls) > 0) == (choice == "flash_attn"), choice
    flash, triton_ = errors["flash_attn"], errors["triton"]
    assert flash.max().item() <= 1.5 * triton_.max().item() + 1e-3, (flash.max().item(), triton_.max().item())
    assert flash.mean().item() <= 1.5 * triton_.mean().item() + 1e-4, (flash.mean().item(), triton_.mean().item())
