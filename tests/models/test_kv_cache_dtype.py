"""``kv_cache_dtype`` in the engine (CPU, torch attention): the flags, an fp8 pool of twice the
tokens, the per-layer scales from a checkpoint or from the first step (``calculate_kv_scales``),
and an engine generating through an fp8 cache."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vllm_actors import LLM, SamplingParams
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.kernels.attention import AttentionMetadata, TorchPagedAttention
from vllm_actors.kernels.kv_quant import K_SCALE_CONSTANT, V_SCALE_CONSTANT
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.runner.model_runner import ModelRunner

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def make_runner(model: Path, **args: Any) -> ModelRunner:
    base: dict[str, Any] = {"dtype": "float32", "device": "cpu", "block_size": 16, "max_model_len": 128,
                            "max_num_batched_tokens": 128, "max_num_seqs": 4, "num_gpu_blocks_override": 16}
    return ModelRunner(EngineConfig(model=str(model), **{**base, **args}))


def scales_of(runner: ModelRunner) -> list[tuple[float, float] | None]:
    return [None if a.k_scale is None or a.v_scale is None else (a.k_scale.item(), a.v_scale.item())
            for a in runner.model.attention_layers()]


def prefill(tokens: list[int], table: list[int]) -> BatchInput:
    n = len(tokens)
    return BatchInput(list(tokens), list(range(n)), [n], [n], [table], list(range(n)))


def test_flags_and_bad_values() -> None:
    from vllm_actors.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8", "--calculate-kv-scales"])
    kwargs = engine_kwargs(args)
    assert kwargs["kv_cache_dtype"] == "fp8" and kwargs["calculate_kv_scales"] is True
    assert engine_kwargs(build_parser().parse_args(["serve"]))["kv_cache_dtype"] == "auto"
    for name in ("fp8", "fp8_e4m3", "fp8_e5m2", "auto"):
        assert EngineConfig(model="m", kv_cache_dtype=name).kv_cache_dtype == name
    from types import SimpleNamespace

    from vllm_actors.server.app import cache_config_labels

    client = SimpleNamespace(info=None, group=SimpleNamespace(config=EngineConfig(model="m", kv_cache_dtype="fp8")))
    assert cache_config_labels(client)["cache_dtype"] == "fp8"  # type: ignore[arg-type]  # vllm:cache_config_info's label
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\)"):
        EngineConfig(model="m", kv_cache_dtype="int8")


def test_fp8_pool_holds_twice_the_tokens_of_bf16(tiny_qwen3: Path) -> None:
    """The same memory budget gives twice the blocks: one byte an element instead of two."""
    budget = {"dtype": "bfloat16", "num_gpu_blocks_override": None, "cpu_kv_cache_gib": 1 / 1024}
    bf16 = make_runner(tiny_qwen3, **budget)
    fp8 = make_runner(tiny_qwen3, kv_cache_dtype="fp8", **budget)
    assert fp8.bytes_per_block * 2 == bf16.bytes_per_block
    assert fp8.num_blocks // 2 == bf16.num_blocks > 100  # floor(budget / (bytes / 2)) = 2 floor(...) or one more
    assert bf16.kv_caches[0][0].dtype == torch.bfloat16
    assert all(k.dtype == v.dtype == E4M3 and k.shape[0] == fp8.num_blocks for k, v in fp8.kv_caches)


def with_kv_scales(checkpoint: Path, target: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A copy of ``checkpoint`` with ``tensors`` in one more safetensors file."""
    shutil.copytree(checkpoint, target)
    save_file(tensors, str(target / "kv_scales.safetensors"))
    return target


def test_scales_from_the_checkpoint(tiny_qwen3: Path, tmp_path: Path) -> None:
    """The names vLLM reads: self_attn.k_scale / v_scale, the older kv_scale (both), ModelOpt's
    k_proj.k_scale / v_proj.v_scale; a layer without scales gets 1.0."""
    model = with_kv_scales(tiny_qwen3, tmp_path / "scaled", {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.125]),
        "model.layers.1.self_attn.kv_scale": torch.tensor(0.5),
        "model.layers.2.self_attn.k_proj.k_scale": torch.tensor(2.0, dtype=torch.bfloat16),
    })  # fmt: skip
    assert scales_of(make_runner(model, kv_cache_dtype="fp8")) == [(0.25, 0.125), (0.5, 0.5), (2.0, 1.0)]
    assert scales_of(make_runner(model)) == [None, None, None]  # a float32 cache takes no scales
    assert scales_of(make_runner(model, kv_cache_dtype="fp8_e5m2")) == [(1.0, 1.0)] * 3  # e5m2: none, as vLLM
    assert scales_of(make_runner(tiny_qwen3, kv_cache_dtype="fp8_e4m3")) == [(1.0, 1.0)] * 3  # vLLM's default
    bad = with_kv_scales(tiny_qwen3, tmp_path / "bad", {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    with pytest.raises(ValueError, match="one value"):
        make_runner(bad, kv_cache_dtype="fp8")


class Recorder(TorchPagedAttention):
    """The torch backend, keeping the k and v each layer attends with."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, kv_written: bool = False,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
        self.seen.append((k.clone(), v.clone()))
        return super().forward(q, k, v, k_cache, v_cache, meta, scale, kv_written, k_scale, v_scale)


def test_calculate_kv_scales_from_the_first_step(tiny_qwen3: Path) -> None:
    runner = make_runner(tiny_qwen3, kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert scales_of(runner) == [(1.0, 1.0)] * 3
    recorder = Recorder()
    runner.model.attn_backend = recorder
    runner.execute(prefill([5, 9, 2, 7, 11, 3, 8, 4, 4, 6], [0]))
    expected = [((k.abs().amax() / K_SCALE_CONSTANT).item(), (v.abs().amax() / V_SCALE_CONSTANT).item())
                for k, v in recorder.seen]
    assert len(expected) == 3 and scales_of(runner) == expected
    assert all(pair != (1.0, 1.0) for pair in expected)
    runner.execute(prefill([1, 2, 3] * 9, [1, 2]))  # later steps keep them
    assert scales_of(runner) == expected
    fixed = make_runner(tiny_qwen3, kv_cache_dtype="fp8")
    fixed.execute(prefill([5, 9, 2, 7], [0]))
    assert scales_of(fixed) == [(1.0, 1.0)] * 3  # without calculate_kv_scales


def test_fp8_logits_near_the_float32_cache(tiny_qwen3: Path) -> None:
    """Through an fp8 cache (calculated scales) the logits of a prefill then a decode step stay
    close to those of a float32 cache, but not identical: the cache is quantised."""
    steps = [prefill(list(range(3, 40)), [0, 1, 2]), BatchInput([17], [37], [1], [38], [[0, 1, 2]], [0])]
    exact, quantised = make_runner(tiny_qwen3), make_runner(tiny_qwen3, kv_cache_dtype="fp8", calculate_kv_scales=True)
    for batch in steps:
        want, got = exact.execute(batch), quantised.execute(batch)
        rel = ((got - want).norm() / want.norm()).item()
        assert 0 < rel < 0.15, rel  # e4m3 keeps 3 mantissa bits: this random model moves 8%


def test_llm_generates_through_an_fp8_cache(tiny_qwen3: Path) -> None:
    prompts = [{"prompt_token_ids": list(range(5, 60))}, {"prompt_token_ids": [7] * 20}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_qwen3), executor="inprocess", kv_cache_dtype="fp8", max_model_len=128,
             num_gpu_blocks_override=32) as llm:
        outputs = llm.generate(prompts, params)
        caches = llm.engine.worker.runner.kv_caches  # type: ignore[attr-defined]  # the in-process engine's
    assert [len(o.outputs[0].token_ids) for o in outputs] == [12, 12]
    assert all(k.dtype == v.dtype == E4M3 for k, v in caches)
    assert all(k.view(torch.uint8).any() and v.view(torch.uint8).any() for k, v in caches)


def test_a_start_that_fails_halfway_frees_its_weights(tiny_qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A runner whose start fails after loading (here its graph capture) lets go of the model and the
    cache before the error reaches the caller, although the error's traceback is still held (on a GPU,
    the next engine of the process would otherwise find the memory taken)."""
    import gc
    import weakref

    models: list[weakref.ref[torch.nn.Module]] = []
    original = ModelRunner._allocate_kv_cache

    def allocate(self: ModelRunner, num_blocks: int) -> Any:
        models.append(weakref.ref(self.model))
        return original(self, num_blocks)

    def capture(self: ModelRunner) -> None:
        raise RuntimeError("capture failed")

    monkeypatch.setattr(ModelRunner, "_allocate_kv_cache", allocate)
    monkeypatch.setattr(ModelRunner, "capture_graphs", capture)
    with pytest.raises(RuntimeError, match="capture failed") as caught:
        make_runner(tiny_qwen3)
    gc.collect()
    assert caught.value.__traceback__ is not None and models and models[0]() is None
