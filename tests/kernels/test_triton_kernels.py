"""The Triton paged-attention kernels against a float64 torch reference.

Without CUDA the kernels run in Triton's interpreter (exact but slow), so the CPU cases are small;
the `gpu` cases run the real model shapes and need a CUDA device. TRITON_INTERPRET must be set
before the kernels are decorated, i.e. before `vllm_actors.kernels.triton_attention` is imported:
it only changes how Triton runs kernels, and nothing else in the suite runs Triton kernels on CPU.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tests.support.paged_batch import shuffled_tables  # noqa: E402
from vllm_actors.kernels import triton_attention as ta  # noqa: E402
from vllm_actors.kernels.attention import (  # noqa: E402
    AttentionMetadata,
    TorchPagedAttention,
    build_attention_metadata,
    get_attention_backend,
    write_kv_cache,
)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA and not ta.INTERPRET:  # imported elsewhere before TRITON_INTERPRET was set
    ta = importlib.reload(ta)
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    """The float32 reference paths must not use TF32 on a GPU."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # new tokens [T, Hkv, D]
    v: torch.Tensor
    k_cache: torch.Tensor  # the cached prefixes written, the new tokens not yet
    v_cache: torch.Tensor
    meta: AttentionMetadata
    expected: torch.Tensor  # float64 [T, H, D]
    scale: float


def make_case(
    specs: list[tuple[int, int]],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    seed: int,
    spare_blocks: int = 3,
    num_blocks: int | None = None,
) -> Case:
    """specs: (cached_len, query_len) per sequence. Block tables are shuffled, the cache is random
    garbage outside the sequences' slots, and the expected output comes from dense float64 math."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, tables = shuffled_tables(specs, block_size, gen, spare_blocks, num_blocks)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    full_k = [torch.randn(c + q, num_kv_heads, head_dim, generator=gen).to(dtype) for c, q in specs]
    full_v = [torch.randn(c + q, num_kv_heads, head_dim, generator=gen).to(dtype) for c, q in specs]
    qs = [torch.randn(q, num_heads, head_dim, generator=gen).to(dtype) for _, q in specs]
    prefix = build_attention_metadata([c for c, _ in specs], [c for c, _ in specs], tables, block_size)
    if prefix.num_tokens:
        write_kv_cache(
            torch.cat([k[:c] for k, (c, _) in zip(full_k, specs)]),
            torch.cat([v[:c] for v, (c, _) in zip(full_v, specs)]),
            k_cache,
            v_cache,
            prefix.slot_mapping,
        )
    scale = head_dim**-0.5
    group = num_heads // num_kv_heads
    expected = []
    for (c, q_len), q, k, v in zip(specs, qs, full_k, full_v):
        kd = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
        vd = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = q.double().transpose(0, 1) @ kd.transpose(1, 2) * scale  # [H, q_len, S]
        visible = torch.arange(c + q_len).unsqueeze(0) <= torch.arange(c, c + q_len).unsqueeze(1)
        scores = scores.masked_fill(~visible, float("-inf"))
        expected.append((torch.softmax(scores, dim=-1) @ vd).transpose(0, 1))
    meta = build_attention_metadata([q for _, q in specs], [c + q for c, q in specs], tables, block_size, DEVICE)
    return Case(
        q=torch.cat(qs).to(DEVICE),
        k=torch.cat([k[c:] for k, (c, _) in zip(full_k, specs)]).to(DEVICE),
        v=torch.cat([v[c:] for v, (c, _) in zip(full_v, specs)]).to(DEVICE),
        k_cache=k_cache.to(DEVICE),
        v_cache=v_cache.to(DEVICE),
        meta=meta,
        expected=torch.cat(expected),
        scale=scale,
    )


def assert_close(out: torch.Tensor, case: Case, dtype: torch.dtype) -> None:
    """Every element written and finite; per sequence ‖out − ref‖/‖ref‖ within the dtype's tolerance,
    and no single token row worse than 5x that."""
    got = out.double().cpu()
    assert torch.isfinite(got).all(), f"{(~torch.isfinite(got)).sum().item()} elements not written or not finite"
    tol = TOLERANCE[dtype]
    start = 0
    for i, q_len in enumerate(case.meta.query_lens_cpu):
        if q_len == 0:
            continue
        ref, part = case.expected[start : start + q_len], got[start : start + q_len]
        rel = ((part - ref).norm() / ref.norm()).item()
        assert rel < tol, f"sequence {i} (query_len {q_len}, seq_len {case.meta.seq_lens_cpu[i]}): rel err {rel:.2e}"
        row_rel = (part - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
        assert row_rel.max().item() < 5 * tol, f"sequence {i}: worst row rel err {row_rel.max().item():.2e}"
        start += q_len


def poisoned_like(q: torch.Tensor) -> torch.Tensor:
    return torch.full_like(q, float("nan"))


def write_new_tokens(case: Case) -> None:
    write_kv_cache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)


def run_varlen(case: Case) -> torch.Tensor:
    write_new_tokens(case)
    out = poisoned_like(case.q)
    m = case.meta
    ta.paged_attention_varlen(
        case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
        m.max_query_len, case.scale, out=out,
    )  # fmt: skip
    return out


def run_decode(case: Case, num_splits: int | None = None, order: torch.Tensor | None = None) -> torch.Tensor:
    write_new_tokens(case)
    out = poisoned_like(case.q)
    m = case.meta
    ta.paged_attention_decode(
        case.q, case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables,
        m.max_seq_len, case.scale, out=out, num_splits=num_splits, order=order,
    )  # fmt: skip
    return out


# ----------------------------------------------------------------------------------------------
# KV write
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 16), (2, 64)])
def test_kv_write_scatters_and_skips_negative_slots(dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads * 1000 + head_dim)
    num_blocks, block_size, tokens = 7, 16, 40
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    # k arrives as a strided view (a slice of a wider projection)
    wide = torch.randn(tokens, 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    k = wide[:, :num_kv_heads]
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::5] = -1  # padding rows of a CUDA-graph batch
    slots = slots.to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    keep = slots >= 0
    write_kv_cache(k[keep], v[keep], expected_k, expected_v, slots[keep])
    ta.write_kv_cache_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


# ----------------------------------------------------------------------------------------------
# Varlen (prefill, chunked prefill, mixed batches) on small shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("length_kind", ["one", "block", "block_plus_one", "long"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_varlen_single_prefill(block_size: int, length_kind: str) -> None:
    length = {"one": 1, "block": block_size, "block_plus_one": block_size + 1, "long": 200}[length_kind]
    case = make_case([(0, length)], block_size, 4, 2, 32, torch.float32, seed=length + block_size)
    assert_close(run_varlen(case), case, torch.float32)


@pytest.mark.parametrize("cached,new", [(7, 5), (16, 17), (15, 2), (31, 33), (150, 40)])
def test_varlen_cached_prefix_plus_chunk(cached: int, new: int) -> None:
    case = make_case([(cached, new)], 16, 6, 2, 32, torch.float32, seed=cached * 100 + new)
    assert_close(run_varlen(case), case, torch.float32)


MIXED = [(0, 1), (0, 16), (19, 1), (5, 17), (32, 7), (40, 1), (0, 33), (16, 0)]


@pytest.mark.parametrize(
    "dtype,heads,head_dim,block_size",
    [
        (torch.float32, (4, 4), 32, 16),  # group 1
        (torch.bfloat16, (4, 2), 32, 16),  # group 2
        (torch.float16, (9, 3), 64, 32),  # group 3 (padded to 4), SmolLM2's head shape
    ],
)
def test_varlen_mixed_prefill_decode(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int, block_size: int
) -> None:
    case = make_case(MIXED, block_size, heads[0], heads[1], head_dim, dtype, seed=heads[0] + block_size)
    assert_close(run_varlen(case), case, dtype)


def test_varlen_head_dim_128() -> None:
    case = make_case([(20, 13), (0, 1)], 16, 2, 1, 128, torch.bfloat16, seed=12)
    assert_close(run_varlen(case), case, torch.bfloat16)


def test_varlen_strided_query() -> None:
    """q as a view into a fused qkv projection (row stride wider than heads x head_dim)."""
    case = make_case([(3, 20), (0, 9)], 16, 4, 2, 32, torch.float32, seed=11)
    wide = torch.randn(case.q.shape[0], 8, 32, device=DEVICE)
    wide[:, :4] = case.q
    case.q = wide[:, :4]
    assert not case.q.is_contiguous()
    assert_close(run_varlen(case), case, torch.float32)


# ----------------------------------------------------------------------------------------------
# Decode on small shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [None, 1, 2, 8])
def test_decode_lengths_and_splits(num_splits: int | None) -> None:
    """Lengths 1, block, block+1 and long; 8 splits leave the short sequences' late splits empty."""
    specs = [(0, 1), (15, 1), (16, 1), (300, 1), (64, 1)]
    case = make_case(specs, 16, 4, 2, 32, torch.float32, seed=5)
    assert_close(run_decode(case, num_splits), case, torch.float32)


@pytest.mark.parametrize(
    "dtype,heads,head_dim,block_size,num_splits",
    [
        (torch.bfloat16, (4, 4), 32, 32, 4),
        (torch.float16, (4, 2), 64, 16, 1),
        (torch.bfloat16, (9, 3), 64, 16, 2),
        (torch.bfloat16, (4, 2), 128, 16, 2),  # Qwen3's head_dim
    ],
)
def test_decode_dtypes_and_groups(
    dtype: torch.dtype, heads: tuple[int, int], head_dim: int, block_size: int, num_splits: int
) -> None:
    specs = [(40, 1), (0, 1), (130, 1)]
    case = make_case(specs, block_size, heads[0], heads[1], head_dim, dtype, seed=heads[0] * 7 + num_splits)
    assert_close(run_decode(case, num_splits), case, dtype)


@pytest.mark.parametrize("early", [False, True], ids=["late", "early-loads"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_skips_sequences_without_a_query(monkeypatch: pytest.MonkeyPatch, num_splits: int, early: bool) -> None:
    """A sequence with no query this step writes nothing (its would-be row belongs to the next one);
    a padded row of length 0 yields zeros rather than NaN. Also with the step's metadata read before
    the PDL wait (``VLLM_ACTORS_PDL_EARLY_LOADS``)."""

    monkeypatch.setenv("VLLM_ACTORS_PDL_EARLY_LOADS", "1" if early else "0")
    case = make_case([(20, 1), (33, 0), (50, 1)], 16, 4, 2, 32, torch.float32, seed=3)
    assert_close(run_decode(case, num_splits), case, torch.float32)

    pad = make_case([(20, 1), (0, 1)], 16, 4, 2, 32, torch.float32, seed=4)
    write_new_tokens(pad)
    pad.meta.seq_lens[1] = 0  # a CUDA-graph padding sequence
    out = poisoned_like(pad.q)
    m = pad.meta
    ta.paged_attention_decode(
        pad.q, pad.k_cache, pad.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, m.max_seq_len,
        pad.scale, out=out, num_splits=num_splits,
    )  # fmt: skip
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
    rel = ((out[0].double().cpu() - pad.expected[0]).norm() / pad.expected[0].norm()).item()
    assert rel < 1e-4


@pytest.mark.parametrize("early", [False, True], ids=["late", "early-loads"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_in_longest_first_order_is_the_same_attention(
    monkeypatch: pytest.MonkeyPatch, num_splits: int, early: bool
) -> None:
    """Programs taking the sequences in another order (the backend's longest-first `decode_order`)
    still write each sequence's own row, also around a sequence without a query this step (also
    with the metadata read before the PDL wait)."""

    monkeypatch.setenv("VLLM_ACTORS_PDL_EARLY_LOADS", "1" if early else "0")
    case = make_case([(20, 1), (300, 1), (33, 0), (0, 1), (130, 1)], 16, 4, 2, 32, torch.float32, seed=8)
    plain = run_decode(case, num_splits)
    order = torch.argsort(case.meta.seq_lens, descending=True)
    assert order.tolist()[0] == 1 and order.tolist() != list(range(5))
    ordered = run_decode(case, num_splits, order=order)
    assert_close(ordered, case, torch.float32)
    rows = case.meta.query_start_loc[-1].item()
    assert torch.equal(ordered[:rows], plain[:rows])


def test_backend_prepare_orders_decode_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    decode = make_case([(20, 1), (300, 1), (7, 1)], 16, 4, 2, 32, torch.float32, seed=9).meta
    prepared = ta.TritonPagedAttention(ordered=True).prepare(decode)
    assert prepared is not decode and decode.decode_order is None  # the caller's metadata is left as it was
    assert prepared.decode_order is not None and prepared.decode_order.tolist() == [1, 0, 2]
    assert ta.TritonPagedAttention(ordered=False).prepare(decode) is decode
    mixed = make_case([(20, 1), (0, 12)], 16, 4, 2, 32, torch.float32, seed=9).meta
    assert ta.TritonPagedAttention(ordered=True).prepare(mixed) is mixed
    assert ta.TritonPagedAttention().ordered is ta.DECODE_ORDERED is True  # the default: longest first


def test_choose_decode_splits() -> None:
    cuda_like = torch.device("cpu")  # 4 "SMs" on CPU
    # 16 waves (TP=2 at batch 256: 1,024 programs on 132 SMs): 2 splits
    assert ta.choose_decode_splits(8, 4, 4096, cuda_like, waves=16) == 2
    assert ta.choose_decode_splits(1, 1, 4096, cuda_like, waves=16) == 32
    with pytest.raises(ValueError, match="waves must be a positive integer"):
        ta.choose_decode_splits(1, 1, 4096, cuda_like, waves=0)
    assert ta.choose_decode_splits(1, 1, 100, cuda_like) == 1  # too short to split
    assert ta.choose_decode_splits(1, 1, 4096, cuda_like) == 8  # 2 waves of 4 "SMs"
    assert ta.choose_decode_splits(64, 8, 4096, cuda_like) == 1  # enough programs already
    assert ta.choose_decode_splits(1, 1, 300, cuda_like) == 2  # >= 128 keys per split
    assert ta.choose_decode_splits(1, 1, 4096, cuda_like, max_splits=2) == 2
    assert ta.choose_decode_splits(1, 1, 4096, cuda_like, max_splits=1) == 1  # no reduction kernel
    for bad in (3, 0, 128):
        with pytest.raises(ValueError, match="max_splits must be a power of two"):
            ta.choose_decode_splits(1, 1, 4096, cuda_like, max_splits=bad)
    # few (sequence, KV head) pairs for the SMs (batch-1 long contexts): twice the waves, 2-stage tiles
    assert ta.few_programs(1, 8, 132) and ta.few_programs(2, 8, 132) and not ta.few_programs(3, 8, 132)
    assert ta.decode_config(64, few=True).num_stages == 2 and ta.decode_config(64).num_stages == 3
    for num_seqs in (1, 3, 17):
        for max_len in (1, 255, 257, 10_000, 1_000_000):
            splits = ta.choose_decode_splits(num_seqs, 2, max_len, cuda_like)
            assert 1 <= splits <= 64 and splits & (splits - 1) == 0


# ----------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_backend_forward_writes_cache_and_attends(kind: str) -> None:
    specs = [(17, 1), (0, 1), (40, 1)] if kind == "decode" else [(17, 1), (0, 12), (40, 3)]
    case = make_case(specs, 16, 6, 3, 32, torch.bfloat16, seed=21)
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv_cache(case.k, case.v, expected_k, expected_v, case.meta.slot_mapping)
    out = ta.TritonPagedAttention().forward(case.q, case.k, case.v, case.k_cache, case.v_cache, case.meta, case.scale)
    assert torch.equal(case.k_cache, expected_k) and torch.equal(case.v_cache, expected_v)
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert_close(out, case, torch.bfloat16)


def test_backend_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ACTORS_ATTENTION", raising=False)
    assert isinstance(get_attention_backend(torch.device("cpu")), TorchPagedAttention)
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "triton")
    assert isinstance(get_attention_backend(torch.device("cpu")), ta.TritonPagedAttention)
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "torch")
    assert isinstance(get_attention_backend(torch.device("cuda")), TorchPagedAttention)
    monkeypatch.setenv("VLLM_ACTORS_ATTENTION", "flash")
    with pytest.raises(ValueError):
        get_attention_backend(torch.device("cpu"))
    if HAS_CUDA:
        monkeypatch.delenv("VLLM_ACTORS_ATTENTION")
        assert isinstance(get_attention_backend(torch.device("cuda")), ta.TritonPagedAttention)


def test_rejects_bad_shapes() -> None:
    case = make_case([(0, 3)], 16, 4, 2, 32, torch.float32, seed=1)
    m = case.meta
    with pytest.raises(ValueError, match="multiple"):
        ta.paged_attention_varlen(
            case.q[:, :3], case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, 3, 1.0
        )
    with pytest.raises(ValueError, match="cache"):
        ta.paged_attention_varlen(
            case.q.half(), case.k_cache, case.v_cache, m.query_start_loc, m.seq_lens, m.block_tables, 3, 1.0
        )
    odd = torch.zeros(4, 16, 2, 24, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        ta.paged_attention_decode(
            torch.zeros(1, 4, 24, device=DEVICE), odd, odd, m.query_start_loc, m.seq_lens, m.block_tables, 3, 1.0
        )


# ----------------------------------------------------------------------------------------------
# Real shapes on a GPU
# ----------------------------------------------------------------------------------------------

QWEN3 = (16, 8, 128)  # heads, kv heads, head_dim of Qwen3-0.6B
SMOLLM2 = (9, 3, 64)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("model", [QWEN3, SMOLLM2], ids=["qwen3", "smollm2"])
def test_gpu_prefill_and_mixed(model: tuple[int, int, int], dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = model
    for block_size in (16, 32):
        specs = [(0, 1024), (512, 300), (0, 1), (1000, 1), (2047, 1), (16, 17), (700, 129)]
        case = make_case(specs, block_size, heads, kv_heads, head_dim, dtype, seed=block_size, spare_blocks=50)
        assert_close(run_varlen(case), case, dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("model", [QWEN3, SMOLLM2], ids=["qwen3", "smollm2"])
def test_gpu_decode(model: tuple[int, int, int], dtype: torch.dtype) -> None:
    heads, kv_heads, head_dim = model
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 15, 16, 17, 4000] + torch.randint(1, 3000, (59,), generator=gen).tolist()
    for block_size in (16, 32):
        case = make_case([(n - 1, 1) for n in lengths], block_size, heads, kv_heads, head_dim, dtype, seed=1)
        for num_splits in (None, 1, 3, 16):
            assert_close(run_decode(case, num_splits), case, dtype)
        single = make_case([(8191, 1)], block_size, heads, kv_heads, head_dim, dtype, seed=2)
        assert ta.choose_decode_splits(1, kv_heads, 8192, DEVICE) > 1
        assert_close(run_decode(single), single, dtype)


@gpu
@needs_cuda
def test_gpu_decode_cuda_graph_replay() -> None:
    """Capture forward for a decode batch once, then replay it with longer contexts and other slots."""
    heads, kv_heads, head_dim = QWEN3
    block_size, batch, max_blocks = 16, 4, 64
    dtype = torch.bfloat16
    backend = ta.TritonPagedAttention()
    num_blocks = 300
    first = make_case(
        [(100, 1), (5, 1), (300, 1), (0, 1)], block_size, heads, kv_heads, head_dim, dtype, 1, num_blocks=num_blocks
    )
    # static inputs sized for the capture: tables padded to max_blocks, max_seq_len an upper bound
    static = {
        "q": first.q.clone(),
        "k": first.k.clone(),
        "v": first.v.clone(),
        "slots": first.meta.slot_mapping.clone(),
        "qsl": first.meta.query_start_loc.clone(),
        "seq_lens": first.meta.seq_lens.clone(),
        "tables": torch.zeros(batch, max_blocks, dtype=torch.int32, device=DEVICE),
    }
    static["tables"][:, : first.meta.block_tables.shape[1]] = first.meta.block_tables
    meta = AttentionMetadata(
        slot_mapping=static["slots"],
        query_start_loc=static["qsl"],
        seq_lens=static["seq_lens"],
        block_tables=static["tables"],
        max_query_len=1,
        max_seq_len=max_blocks * block_size,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=[max_blocks * block_size] * batch,
    )
    k_cache, v_cache = first.k_cache, first.v_cache

    def step() -> torch.Tensor:
        return backend.forward(static["q"], static["k"], static["v"], k_cache, v_cache, meta, first.scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()

    for seed, specs in enumerate([[(100, 1), (5, 1), (300, 1), (0, 1)], [(900, 1), (15, 1), (16, 1), (1000, 1)]]):
        case = make_case(specs, block_size, heads, kv_heads, head_dim, dtype, seed=10 + seed, num_blocks=num_blocks)
        k_cache.copy_(case.k_cache)
        v_cache.copy_(case.v_cache)
        for name, value in (("q", case.q), ("k", case.k), ("v", case.v)):
            static[name].copy_(value)
        static["slots"].copy_(case.meta.slot_mapping)
        static["seq_lens"].copy_(case.meta.seq_lens)
        static["tables"].zero_()
        static["tables"][:, : case.meta.block_tables.shape[1]] = case.meta.block_tables
        graph.replay()
        torch.cuda.synchronize()
        assert_close(static_out.clone(), case, dtype)


@gpu
@needs_cuda
def test_gpu_penalties_kernel_at_full_size() -> None:
    """kernels/penalties.py on the GPU at Qwen3's vocabulary and 230 penalised rows of 256, with the
    pool's slots scattered: equal to the torch path (both float32, same formula)."""
    from vllm_actors.kernels import penalties

    generator = torch.Generator(device=DEVICE).manual_seed(0)
    vocab, num_slots = 151936, 300
    logits = torch.randn((256, vocab), device=DEVICE, generator=generator) * 5
    prompt_seen = torch.rand((num_slots, vocab), device=DEVICE, generator=generator) < 0.01
    output_counts = (torch.rand((num_slots, vocab), device=DEVICE, generator=generator) < 0.005).float() * 3
    rows = torch.randperm(256, device=DEVICE, generator=generator)[:230]
    slots = torch.randperm(num_slots, device=DEVICE, generator=generator)[:230]
    scalars = torch.rand((3, 230), device=DEVICE, generator=generator) + 0.5
    expected, result = logits.clone(), logits.clone()
    penalties.apply_penalties_torch(expected, rows, slots, prompt_seen, output_counts, scalars)
    penalties.apply_penalties(result, rows, slots, prompt_seen, output_counts, scalars)
    torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-5)
