"""The Triton kernels at real model shapes on a GPU (marked ``gpu``, skipped without CUDA): paged
attention for prefill, mixed and decode batches, decode under CUDA-graph replay, and the penalties
kernel at Qwen3's vocabulary."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.support.paged_attention_case import (  # noqa: E402
    DEVICE,
    AttentionMetadata,
    _exact_fp32_matmuls,  # noqa: F401 (autouse: float32 references without TF32)
    assert_close,
    captured,
    gpu,
    make_case,
    needs_cuda,
    run_decode,
    run_varlen,
    ta,
)

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

    graph, static_out = captured(step)

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
