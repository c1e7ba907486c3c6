"""Which path a worker op takes: its Triton kernel or torch, by device and an environment switch."""

from __future__ import annotations

import os

import torch


def use_triton(variable: str, have_triton: bool, device: torch.device) -> bool:
    """The Triton kernel on CUDA devices; ``$variable=torch``: never; ``=triton``: also elsewhere
    (e.g. the CPU under ``TRITON_INTERPRET=1``)."""
    choice = os.environ.get(variable, "").strip().lower()
    if choice not in ("", "torch", "triton"):
        raise ValueError(f"{variable} must be 'torch' or 'triton', got {choice!r}")
    if not have_triton or choice == "torch":
        return False
    return choice == "triton" or device.type == "cuda"
