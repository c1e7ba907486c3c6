"""The device and dtype a worker runs on, from the engine's ``device`` and ``dtype`` settings."""

from __future__ import annotations

import gc
import traceback
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(name: str, rank: int | None = None) -> torch.device:
    """``rank``: a tensor-parallel rank, pinned to GPU ``rank`` (where ``name`` names no index)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but CUDA is not available")
    if device.type == "cuda" and rank is not None:
        if device.index is not None:
            raise ValueError(f"device {name!r}: a tensor-parallel worker takes GPU <rank>; pass 'cuda' or 'auto'")
        device = torch.device("cuda", rank)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str) -> torch.dtype:
    """'auto' is float32 on CPU (exact, and fast enough for small models); on a GPU it is the
    checkpoint's half type, with float32 checkpoints run in bfloat16 (as vLLM does)."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return _DTYPES[checkpoint_dtype]
    return torch.bfloat16


# What a runner holds on the device (a half-built one may lack some)
_DEVICE_ATTRIBUTES = ("drafter", "model", "kv_caches", "host_tier", "_staging", "_graphs", "_sampled_graphs",
                      "_static", "_padded", "_stage_io")


def free_after_failed_start(runner: Any, exc: BaseException) -> None:
    """A runner's start that failed halfway (a graph capture, no memory left) gives its device memory
    back at once: the error's frames and the half-built runner would otherwise hold it while the
    caller reports the error (the next engine in the process then finds the GPU full)."""
    traceback.clear_frames(exc.__traceback__)
    for name in _DEVICE_ATTRIBUTES:
        runner.__dict__.pop(name, None)
    gc.collect()
    if runner.device.type == "cuda":
        torch.cuda.empty_cache()
