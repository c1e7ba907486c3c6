"""Which path a worker op takes: its Triton kernel or torch (the one decision: ``kernels/choice.py``)."""

from __future__ import annotations

from vllm_actors.kernels.choice import use_triton

__all__ = ["use_triton"]
