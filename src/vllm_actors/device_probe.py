"""What the frontend can tell of the GPUs before any worker starts, without initialising CUDA in its
own process (it may be embedded in a service that forks): compute capabilities, memory and names from
NVML, and what an engine takes when none is given: the KV block size (``default_block_size``) and the
offline LLM class's step budget (``offline_batched_tokens``)."""

from __future__ import annotations

import ctypes
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from vllm_actors.envs import envs

# flash-attn 4's SM90 kernel loads a page by TMA only when it is exactly its key tile (128 tokens at
# head_dim 64 and 128); other sizes take a slower gather (docs/performance.md, "Prefill attention").
HOPPER_BLOCK_SIZE = 128
BLOCK_SIZE = 16  # vLLM's default elsewhere
# Tokens a step of the offline LLM class takes when none are given: vLLM's defaults for its LLM class,
# 16,384 on GPUs of 70 GiB or more except the A100 (its measured loss, vLLM PR 17885), else the
# scheduler's 8,192 (the server's everywhere, as vLLM's on such GPUs).
OFFLINE_BATCHED_TOKENS = 16384
LARGE_GPU_BYTES = 70 * 1024**3


@dataclass(frozen=True)
class GpuInfo:
    """One visible GPU as NVML reports it."""

    capability: tuple[int, int]
    memory_bytes: int
    name: str


class _Memory(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


@functools.cache
def visible_gpus() -> tuple[GpuInfo, ...]:
    """Every GPU this process may use (``CUDA_VISIBLE_DEVICES`` when it lists indices), from NVML; ()
    where there is no NVIDIA driver or NVML fails on one of them."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return ()
    if nvml.nvmlInit_v2() != 0:
        return ()
    try:
        count = ctypes.c_uint()
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return ()
        found = []
        for index in _visible_indices(count.value):
            handle, major, minor, memory = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int(), _Memory()
            name = ctypes.create_string_buffer(96)
            if (nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0
                    or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0
                    or nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0
                    or nvml.nvmlDeviceGetName(handle, name, ctypes.c_uint(len(name))) != 0):
                return ()
            found.append(GpuInfo((major.value, minor.value), memory.total, name.value.decode(errors="replace")))
        return tuple(found)
    finally:
        nvml.nvmlShutdown()


def gpu_capabilities() -> tuple[tuple[int, int], ...]:
    """(major, minor) of every visible GPU; () where there is no NVIDIA driver."""
    return tuple(gpu.capability for gpu in visible_gpus())


def _visible_indices(count: int) -> list[int]:
    """NVML indices of the visible devices: ``CUDA_VISIBLE_DEVICES`` as indices, else all (UUIDs and
    an unparsable list count as all: every GPU of a host is asked)."""
    visible = envs.CUDA_VISIBLE_DEVICES
    if visible is None:
        return list(range(count))
    try:
        indices = [int(part) for part in visible.split(",") if part.strip()]
    except ValueError:
        return list(range(count))
    return [index for index in indices if 0 <= index < count]


def flash_attn_installed() -> bool:
    """flash-attn 4 (``flash_attn.cute``) is on the path: found without importing the CuTe DSL."""
    spec = importlib.util.find_spec("flash_attn")
    locations = list(spec.submodule_search_locations or ()) if spec is not None else []
    return any((Path(location) / "cute" / "__init__.py").is_file() for location in locations)


def default_block_size(dtype: str = "auto", device: str = "auto", *,
                       capabilities: tuple[tuple[int, int], ...] | None = None, flash_attn: bool | None = None) -> int:
    """The KV block size when none is given: 128 where the engine runs on GPUs (``device`` not
    "cpu"), every visible one is Hopper and flash-attn 4 may take the prefills (the end-to-end gain:
    RESULTS.md, twenty-seventh session), else 16 (also for float32 models, which flash-attn never takes)."""
    if device.startswith("cpu") or dtype in ("float32", "float") or envs.VLLM_ACTORS_PREFILL_ATTENTION == "triton":
        return BLOCK_SIZE
    capabilities = gpu_capabilities() if capabilities is None else capabilities
    if not capabilities or any(major != 9 for major, _ in capabilities):
        return BLOCK_SIZE
    return HOPPER_BLOCK_SIZE if (flash_attn_installed() if flash_attn is None else flash_attn) else BLOCK_SIZE


def offline_batched_tokens(device: str = "auto", *, gpus: tuple[GpuInfo, ...] | None = None) -> int | None:
    """``max_num_batched_tokens`` for the offline LLM class when none is given: ``OFFLINE_BATCHED_TOKENS``
    where the engine runs on GPUs that are all large and none an A100, else None (the scheduler's
    default). Prefills of long prompts take half as many chunks (RESULTS.md, twenty-eighth session)."""
    if device.startswith("cpu"):
        return None
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus or any(gpu.memory_bytes < LARGE_GPU_BYTES or "a100" in gpu.name.lower() for gpu in gpus):
        return None
    return OFFLINE_BATCHED_TOKENS
