"""flash-attn 4's prefill of a short chunk over a long context split over its keys
(``kernels/flash_attn_split.py``), without flash-attn: the plan, its device tensors, and the two calls
merged by log-sum-exp against the torch reference (a torch model of flash_attn_varlen_func at the
boundary). The real kernel: tests/gpu/test_gpu_flash_attn_prefill.py."""

from __future__ import annotations

import pytest
import torch

from tests.support.paged_batch import VarlenRecorder, paged_batch
from vllm_actors.kernels import prefill_choice
from vllm_actors.kernels.attention import build_attention_metadata
from vllm_actors.kernels.flash_attn_prefill import FlashAttnPrefill
from vllm_actors.kernels.flash_attn_split import MIN_SPLIT_KEYS, plan_key_splits, split_tensors
from vllm_actors.kernels.prefill_choice import prefill_kernel


def test_the_plan_splits_only_a_chunk_that_leaves_sms_idle_over_a_long_context() -> None:
    # a 1M-token prompt's 256-token chunk beside 140 decodes (Llama-3.2-1B: 32 heads over 8, 132 SMs):
    # 8 tiles x 8 KV heads = 64 CTAs; split in ranges of whole blocks over the keys before its last block
    lens = [256] + [1] * 140
    seqs = [400_000 + 256] + [2300] * 140
    plan = plan_key_splits(lens, seqs, 16, 32, 8, 132)
    assert plan is not None and plan.seq == 0 and plan.q_start == 0 and plan.q_len == 256
    assert plan.tail_block == 400_000 // 16 and plan.num_splits == 5  # ceil(2 waves x 132 / 64)
    assert plan.blocks_per_split * (plan.num_splits - 1) < plan.tail_block <= plan.blocks_per_split * plan.num_splits
    # the chunk's rows are found wherever it sits in the batch
    moved = plan_key_splits([1, 1, 256], [900, 800, 400_256], 16, 32, 8, 132)
    assert moved is not None and moved.seq == 2 and moved.q_start == 2
    # beside a longer fresh prompt (a short request's 2,048 tokens) it is still the chunk over the long
    # context that is split, not the step's longest query
    mixed = plan_key_splits([2048, 68] + [1] * 120, [2048, 660_068] + [2300] * 120, 16, 32, 8, 132)
    assert mixed is not None and mixed.seq == 1 and mixed.q_start == 2048 and mixed.q_len == 68
    # a chunk that fills the GPU, a decode step, a short context: one call
    assert plan_key_splits([4096], [500_000], 16, 32, 8, 132) is None
    assert plan_key_splits([1, 1], [400_000, 5], 16, 32, 8, 132) is None
    assert plan_key_splits([256], [2 * MIN_SPLIT_KEYS - 16 + 256], 16, 32, 8, 132) is None
    # ranges hold MIN_SPLIT_KEYS keys at least
    few = plan_key_splits([64], [3 * MIN_SPLIT_KEYS + 64], 16, 32, 8, 132)
    assert few is not None and few.num_splits == 3


def test_the_split_tensors_cover_the_keys_once() -> None:
    block_size = 16
    table = list(range(100, 100 + 40))  # 40 blocks: 630 keys cached, a 10-token chunk
    meta = build_attention_metadata([1, 10], [20, 640], [[7, 8], table], block_size)
    plan = plan_key_splits(meta.query_lens_cpu, meta.seq_lens_cpu, block_size, 4, 2, 1)
    assert plan is None  # 630 keys: too short for two ranges of MIN_SPLIT_KEYS
    from vllm_actors.kernels.flash_attn_split import KeySplits

    plan = KeySplits(seq=1, q_start=1, q_len=10, seq_len=640, tail_block=39, blocks_per_split=10, num_splits=4)
    tensors = split_tensors(plan, meta.block_tables, meta.seq_lens, block_size)
    assert tensors.tail_seqused.tolist() == [20, 640 - 39 * 16]
    assert tensors.tail_page_table[1, 0].item() == 139 and tensors.tail_page_table[0, :2].tolist() == [7, 8]
    assert tensors.split_seqused.tolist() == [160, 160, 160, 9 * 16]
    covered = [tensors.split_page_table[i, : n // 16].tolist() for i, n in enumerate(tensors.split_seqused.tolist())]
    assert sum(covered, []) == table[:39]
    assert tensors.split_cu_seqlens.tolist() == [0, 10, 20, 30, 40]
    assert all(t.dtype == torch.int32 for t in (tensors.tail_page_table, tensors.split_page_table))


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_a_split_step_equals_the_reference(softcap: float | None) -> None:
    """A 64-token chunk over 3 ranges of MIN_SPLIT_KEYS keys beside two decodes, GQA 4/2, in float32:
    the step's call (its tail, causal) and the ranges' call (non-causal), merged, give the reference's
    output, as one unsplit call does."""
    context = 3 * MIN_SPLIT_KEYS + 37  # a partial last block before the chunk
    batch = paged_batch([(100, 1), (context, 64), (2000, 1)], 16, 4, 2, 16, torch.float32, seed=3)
    expected = batch.reference()
    batch.write_new_tokens()
    if softcap is not None:
        from vllm_actors.kernels.attention import TorchPagedAttention

        expected = TorchPagedAttention().forward(
            batch.q, batch.k, batch.v, batch.k_cache.clone(), batch.v_cache.clone(), batch.meta, batch.scale,
            logits_soft_cap=softcap, kv_written=True,
        )  # fmt: skip
    recorder = VarlenRecorder()
    split = FlashAttnPrefill("flash_attn", recorder, split_keys=True, num_sms=3)
    out = split(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, logits_soft_cap=softcap)
    assert [(c["causal"], c.get("return_lse", False), c["q"].shape[0]) for c in recorder.calls] == \
        [(True, True, 66), (False, True, 3 * 64)]
    assert ((out - expected).norm() / expected.norm()).item() < 1e-5
    whole = FlashAttnPrefill("flash_attn", VarlenRecorder(), split_keys=False, num_sms=3)
    unsplit = whole(batch.q, batch.k_cache, batch.v_cache, batch.meta, batch.scale, logits_soft_cap=softcap)
    assert ((unsplit - out).norm() / unsplit.norm()).item() < 1e-5
    # a windowed layer is never split (its keys are not the whole context)
    windowed = FlashAttnPrefill("flash_attn", VarlenRecorder(), split_keys=True, num_sms=3)
    assert windowed.splits(batch.q, batch.k_cache, batch.meta, sliding_window=512) is None


def test_auto_takes_flash_attn_for_shorter_chunks_where_it_splits() -> None:
    keys = prefill_choice.LONG_CONTEXT_KEYS
    shortest = prefill_choice.SPLIT_MIN_QUERY_LEN
    assert prefill_kernel("auto", True, shortest, 64, keys, split=True) == "flash_attn"
    assert prefill_kernel("auto", True, shortest, 64, keys) == "triton"
    assert prefill_kernel("auto", True, shortest - 1, 64, keys, split=True) == "triton"
    # beside decodes at head_dim 64 the keys weight still applies
    assert prefill_kernel("auto", True, 128, 64, 400_000, num_seqs=141, other_keys=140 * 2300,
                          split=True) == "flash_attn"
    assert prefill_kernel("auto", True, 128, 64, 16384, num_seqs=64, other_keys=63 * 16384, split=True) == "triton"


def test_steps_flash_attn_takes_by_their_context_leave_the_padded_graphs() -> None:
    """The padded graph of a step's size chose its kernel at capture from the token count alone: a
    short chunk over a long context (split or not) runs eagerly, other steps keep their graph."""
    prefill = FlashAttnPrefill("auto", VarlenRecorder(), split_keys=True, num_sms=132)
    cpu = torch.device("cpu")

    def eager(lens: list[int], seqs: list[int], padded: int) -> bool:
        return prefill.outruns_padded_graph(lens, seqs, 16, 32, 8, 64, padded, cpu)

    assert eager([256] + [1] * 140, [400_256] + [2300] * 140, 512)  # split: the graph cannot
    assert not eager([4096], [504_096], 4096)  # the graph of 4,096 rows is flash-attn's already, no split
    assert not eager([1] * 64, [3000] * 64, 64)  # decodes
    assert not eager([300, 1], [300, 900], 512)  # a fresh short prompt: Triton either way
    assert eager([300], [300 + prefill_choice.LONG_CONTEXT_KEYS], 512)  # alone over a long context, unsplit
    # a fresh 1,000-token prompt beside the long prompt's 68-token chunk: the chunk's split takes the step
    assert eager([1000, 68] + [1] * 120, [1000, 660_068] + [2300] * 120, 2048)
    unsplit = FlashAttnPrefill("auto", VarlenRecorder(), split_keys=False, num_sms=132)
    assert not unsplit.outruns_padded_graph([128] + [1] * 140, [400_128] + [2300] * 140, 16, 32, 8, 64, 512, cpu)
