"""The sharded model alone: TP=2 and TP=3 ranks over gloo (spawned processes, one per rank) give
the logits of TP=1 within float32 rounding, for Qwen3 (one KV head, replicated) and Llama (KV
heads split; untied LM head), from safetensors and from GGUF, and for the mixture-of-experts
models (every expert's intermediate size split, the router replicated); and the shard layout itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.support.tiny_models import build_gguf
from tests.support.tp_ranks import STEPS, run_rank, sharded_logits
from vllm_actors.models.config import ModelConfig
from vllm_actors.models.parallel import ShardLayout


def _spawned_logits(model_path: str | list[str], tp_size: int, tmp_path: Path) -> Any:
    """The ranks' logits of every step (a list of them per model when ``model_path`` is a list)."""
    store, out = tmp_path / f"store-{tp_size}", tmp_path / f"logits-{tp_size}.pt"
    mp.spawn(run_rank, args=(tp_size, str(store), model_path, str(out)), nprocs=tp_size, join=True)
    return torch.load(out)


def _assert_close(got: list[dict[int, torch.Tensor]], want: list[dict[int, torch.Tensor]],
                  tolerance: float = 1e-4) -> None:
    assert len(got) == len(want) == len(STEPS)
    for step_got, step_want in zip(got, want, strict=True):
        for seq, logits in step_want.items():
            assert step_got[seq].shape == logits.shape
            torch.testing.assert_close(step_got[seq], logits, atol=tolerance, rtol=tolerance)
            assert torch.equal(step_got[seq].argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("tp_size", [3])  # TP=2: the tests below, and process_group/test_tensor_parallel.py end to end
@pytest.mark.parametrize("model", ["tiny_qwen3_tp", "tiny_llama_tp"])
def test_sharded_logits_match_tp1(model: str, tp_size: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    path = str(request.getfixturevalue(model))
    _assert_close(_spawned_logits(path, tp_size, tmp_path), sharded_logits(path, 1))


def test_sharded_logits_two_kv_heads_split_and_experts(tiny_qwen3: Path, tiny_qwen3_moe: Path, tiny_mixtral: Path,
                                                        tmp_path: Path) -> None:
    """The default tiny Qwen3 (4 heads, 2 KV heads, tied embeddings): one KV head per rank at TP=2;
    Qwen3-MoE (a dense layer among sparse ones) and Mixtral: half of every expert's intermediate
    size per rank. One spawn of two ranks runs the three models."""
    paths = [str(tiny_qwen3), str(tiny_qwen3_moe), str(tiny_mixtral)]
    for got, path in zip(_spawned_logits(paths, 2, tmp_path), paths, strict=True):
        _assert_close(got, sharded_logits(path, 1))


def test_sharded_logits_from_gguf(tiny_llama_tp: Path, tmp_path: Path) -> None:
    gguf_path = str(build_gguf(tiny_llama_tp, tmp_path / "tiny.gguf"))
    _assert_close(_spawned_logits(gguf_path, 2, tmp_path), sharded_logits(gguf_path, 1))


def _config(heads: int, kv: int, inter: int = 96, vocab: int = 10) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=vocab, hidden_size=32, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
        rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, qk_norm=False,
        attention_bias=False, mlp_bias=False, eos_token_ids=[0], bos_token_id=None, torch_dtype="float32",
        source="hf", path="",
    )


def test_shard_layout_kv_heads_and_vocabulary() -> None:
    # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1 (their query heads' group)
    heads = [ShardLayout(_config(8, 2), rank, 4) for rank in range(4)]
    assert [layout.first_kv_head for layout in heads] == [0, 0, 1, 1]
    assert all(layout.num_kv_heads == 1 and layout.num_heads == 2 for layout in heads)
    assert heads[2].slice_of("model.layers.0.self_attn.k_proj.weight") == (0, 4, 8, 8)
    assert heads[3].slice_of("model.layers.0.self_attn.o_proj.weight") == (1, 24, 32, 32)
    assert heads[3].rank0_only("model.layers.0.mlp.down_proj.bias")
    assert heads[0].slice_of("model.norm.weight") is None
    # vocabulary 10 over 3 ranks: 4, 4, 2 rows (the last padded to 4)
    vocab = [ShardLayout(_config(6, 6), rank, 3) for rank in range(3)]
    assert [(layout.vocab_start, layout.vocab_rows) for layout in vocab] == [(0, 4), (4, 4), (8, 2)]
    assert vocab[2].local_config().vocab_size == 4


@pytest.mark.parametrize(("heads", "kv", "inter", "size", "match"), [
    (6, 2, 96, 4, "num_attention_heads"),
    (6, 3, 96, 2, "num_key_value_heads"),
    (6, 2, 96, 3, "num_key_value_heads"),
    (6, 6, 100, 3, "intermediate_size"),
])
def test_shard_layout_refuses_uneven_splits(heads: int, kv: int, inter: int, size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShardLayout(_config(heads, kv, inter), 0, size)


def test_sharded_logits_from_quantized_gguf(default_gguf_path: str, tmp_path: Path) -> None:
    """SmolLM2-135M in Q4_1 (9 heads, 3 KV heads, intermediate 1536) over 3 ranks: each reads its
    quantized rows (q/k/v, gate/up, vocabulary) or whole rows cut to its columns (o/down). Its 30
    layers add up more float32 rounding than the tiny models' 2: sums split over 3 ranks differed from
    one process by 1.4e-4 in one logit of 49,152 under load, so the bound is 5e-4 here."""
    _assert_close(_spawned_logits(default_gguf_path, 3, tmp_path), sharded_logits(default_gguf_path, 1), 5e-4)


def test_the_all_reduce_is_chosen_from_the_environment() -> None:
    """``VLLM_ACTORS_TP_ALLREDUCE``: on GPUs by default the two-shot symmetric-memory all-reduce from
    64 KiB up to ``SYMM_MAX_BYTES`` (NCCL outside that band), or the one-shot, or
    NCCL alone; gloo on the CPU; anything else a clear error."""
    from types import SimpleNamespace

    from vllm_actors.models.parallel import SymmMemAllReduce, symm_all_reduce_from_env

    group = SimpleNamespace(group_name="0")
    assert symm_all_reduce_from_env({"VLLM_ACTORS_TP_ALLREDUCE": "nccl"}, group, on_cuda=True) is None
    assert symm_all_reduce_from_env({}, group, on_cuda=False) is None
    default = symm_all_reduce_from_env({}, group, on_cuda=True)
    assert isinstance(default, SymmMemAllReduce) and default.method == "two_shot"
    assert (default.min_bytes, default.max_bytes) == (64 << 10, 8 << 20)
    two = symm_all_reduce_from_env({"VLLM_ACTORS_TP_ALLREDUCE": "symm_mem", "VLLM_ACTORS_TP_SYMM_MIN_BYTES": "0"},
                                   group, on_cuda=True)
    assert isinstance(two, SymmMemAllReduce) and two.method == "two_shot" and two.max_bytes == 8 << 20
    one = symm_all_reduce_from_env({"VLLM_ACTORS_TP_ALLREDUCE": "symm_mem_one_shot"}, group, on_cuda=True)
    assert one is not None and one.method == "one_shot" and one.max_bytes == 8 << 20  # SYMM_MAX_BYTES, a constant
    assert not one.fits(torch.zeros(4))  # a CPU tensor never goes through symmetric memory
    banded = symm_all_reduce_from_env({"VLLM_ACTORS_TP_ALLREDUCE": "symm_mem",
                                       "VLLM_ACTORS_TP_SYMM_MIN_BYTES": "65536"}, group, on_cuda=True)
    assert banded is not None and (banded.min_bytes, two.min_bytes) == (64 << 10, 0)

    def on_gpu(numel: int) -> Any:  # what ``fits`` reads of a bf16 CUDA tensor
        return SimpleNamespace(device=torch.device("cuda", 0), numel=lambda: numel, element_size=lambda: 2)

    # batch 1 of hidden 4,096 (8 KiB) stays on NCCL; batch 8 (64 KiB) up to 8 MiB go through it
    assert [banded.fits(on_gpu(n)) for n in (4096, 8 * 4096, 4 << 20, (4 << 20) + 1)] == [False, True, True, False]
    assert two.fits(on_gpu(4096))
    with pytest.raises(ValueError, match="VLLM_ACTORS_TP_ALLREDUCE must be one of nccl, symm_mem"):
        symm_all_reduce_from_env({"VLLM_ACTORS_TP_ALLREDUCE": "custom"}, group, on_cuda=True)
