"""The Triton decode paged-attention kernel against a float64 torch reference, on small shapes
(Triton's interpreter without CUDA): lengths, split-K reductions, dtypes and head groups, sequences
without a query, the longest-first order, and how many splits a batch gets."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.support.paged_attention_case import (  # noqa: E402
    _exact_fp32_matmuls,  # noqa: F401 (autouse: float32 references without TF32)
    assert_close,
    make_case,
    poisoned_like,
    run_decode,
    ta,
    write_new_tokens,
)


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



def test_a_long_context_among_short_ones_gets_the_splits_its_share_asks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """H200, 1B shape: one 400k-token context among 120 of 2k decoded in one program per head (85 ms a step)
    while the others were long done. With the batch's keys known, its programs hold a wave's share of them;
    uniform lengths keep the count chosen without; a graph captured for 128 sequences (every length taken as
    max_model_len: 1 split) falls short of such a step, which then runs eagerly; a batch of short or uniform
    contexts keeps its graph."""
    from vllm_actors.kernels import decode_splits as td

    monkeypatch.setattr(td, "_sm_count", lambda device: 132)
    device = torch.device("cpu")
    lens = [400_000] + [2_048] * 120
    assert td.choose_decode_splits(121, 8, 400_000, device) == 1
    assert td.choose_decode_splits(121, 8, 400_000, device, total_seq_len=sum(lens)) == 16  # ceil(21.0) -> 16
    assert td.choose_decode_splits(121, 8, 2_048, device, total_seq_len=121 * 2_048) == 1
    assert td.choose_decode_splits(4, 8, 4_096, device, total_seq_len=4 * 4_096) == \
        td.choose_decode_splits(4, 8, 4_096, device)  # uniform: as without
    assert td.decode_graph_falls_short(lens, 128, 8, 403_000, device)
    assert not td.decode_graph_falls_short([2_048] * 121, 128, 8, 403_000, device)
    assert not td.decode_graph_falls_short([30_000] + [2_048] * 120, 128, 8, 403_000, device)  # not long
    assert not td.decode_graph_falls_short([400_000] * 121, 128, 8, 403_000, device)  # uniform: as captured

