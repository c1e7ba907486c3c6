"""The KV block size an engine takes when none is given: 128 on Hopper GPUs with flash-attn 4 (its
TMA page loads), 16 elsewhere; a given size is kept; found without initialising CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_actors import device_probe
from vllm_actors.device_probe import default_block_size, flash_attn_installed
from vllm_actors.engine_args import make_engine_config

HOPPER, AMPERE = (9, 0), (8, 0)


def test_hopper_with_flash_attn_takes_blocks_of_128() -> None:
    assert default_block_size(capabilities=(HOPPER,), flash_attn=True) == 128
    assert default_block_size("bfloat16", capabilities=(HOPPER, HOPPER), flash_attn=True) == 128


@pytest.mark.parametrize(("capabilities", "flash_attn"), [
    ((), True),  # no NVIDIA driver: the CPU
    ((AMPERE,), True),
    ((HOPPER, AMPERE), True),  # a mixed host: the size every GPU gains from, 16
    ((HOPPER,), False),
])
def test_elsewhere_blocks_of_16(capabilities: tuple[tuple[int, int], ...], flash_attn: bool) -> None:
    assert default_block_size(capabilities=capabilities, flash_attn=flash_attn) == 16


def test_prefill_attention_set_to_triton_keeps_16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ACTORS_PREFILL_ATTENTION", "triton")
    assert default_block_size(capabilities=(HOPPER,), flash_attn=True) == 16


def test_a_cpu_engine_keeps_16_on_a_hopper_host() -> None:
    assert default_block_size(device="cpu", capabilities=(HOPPER,), flash_attn=True) == 16


@pytest.mark.parametrize("dtype", ["float32", "float"])
def test_float32_models_keep_16(dtype: str) -> None:
    """flash-attn never takes float32: the GPU tests' float32 engines keep pools sized in 16-token blocks."""
    assert default_block_size(dtype, capabilities=(HOPPER,), flash_attn=True) == 16


def test_flash_attn_found_by_its_cute_package_without_importing_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not flash_attn_installed(), "flash-attn 2 (no cute package) is not flash-attn 4"
    (package / "cute").mkdir()
    (package / "cute" / "__init__.py").write_text("raise RuntimeError('imported')")
    assert flash_attn_installed()


@pytest.mark.parametrize(("visible", "expected"), [
    (None, [0, 1, 2, 3]), ("2,0", [2, 0]), ("", []), ("GPU-1234", [0, 1, 2, 3]), ("1,7", [1]),
])
def test_visible_devices_as_nvml_indices(visible: str | None, expected: list[int],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert device_probe._visible_indices(4) == expected


def test_engine_config_takes_the_devices_size_only_when_none_is_given(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    monkeypatch.setattr(device_probe, "visible_gpus", lambda: (H100,))
    monkeypatch.setattr(device_probe, "flash_attn_installed", lambda: True)
    model = str(tmp_path)
    assert make_engine_config(model, {}).block_size == 128
    assert make_engine_config(model, {"block_size": None}).block_size == 128
    assert make_engine_config(model, {"block_size": 32}).block_size == 32
    assert make_engine_config(model, {"device": "cpu"}).block_size == 16
    assert make_engine_config(model, {"dtype": "float32"}).block_size == 16


def test_this_machine_answers_without_cuda() -> None:
    import torch

    assert isinstance(device_probe.gpu_capabilities(), tuple)
    if not torch.cuda.is_available():
        assert default_block_size() == 16


H100 = device_probe.GpuInfo(HOPPER, 80 * 1024**3, "NVIDIA H100 80GB HBM3")
A100 = device_probe.GpuInfo(AMPERE, 80 * 1024**3, "NVIDIA A100-SXM4-80GB")
L4 = device_probe.GpuInfo((8, 9), 24 * 1024**3, "NVIDIA L4")


@pytest.mark.parametrize(("gpus", "device", "expected"), [
    ((H100,), "auto", 16384), ((H100, H100), "cuda", 16384),
    ((H100,), "cpu", None), ((), "auto", None),  # a CPU engine; no driver
    ((A100,), "auto", None), ((L4,), "auto", None), ((H100, L4), "auto", None),  # vLLM's exceptions
])
def test_offline_step_budget_is_vllms_llm_class_default(gpus: tuple[device_probe.GpuInfo, ...], device: str,
                                                        expected: int | None) -> None:
    assert device_probe.offline_batched_tokens(device, gpus=gpus) == expected


def test_only_the_offline_class_takes_the_larger_budget(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(device_probe, "visible_gpus", lambda: (H100,))
    model = str(tmp_path)
    assert make_engine_config(model, {}, offline=True).max_num_batched_tokens == 16384
    assert make_engine_config(model, {}).max_num_batched_tokens is None  # the server: the scheduler's 8,192
    assert make_engine_config(model, {"max_num_batched_tokens": 4096}, offline=True).max_num_batched_tokens == 4096
    assert make_engine_config(model, {"enable_chunked_prefill": False}, offline=True).max_num_batched_tokens is None


def test_this_machine_lists_its_gpus_without_cuda() -> None:
    import torch

    gpus = device_probe.visible_gpus()
    assert all(gpu.memory_bytes > 0 and gpu.name for gpu in gpus)
    if not torch.cuda.is_available():
        assert device_probe.offline_batched_tokens() is None
