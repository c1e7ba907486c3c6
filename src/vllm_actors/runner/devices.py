"""The device and dtype a worker runs on, from the engine's ``device`` and ``dtype`` settings."""

from __future__ import annotations

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
