"""The device side of LoRA: each fused projection's adapters stacked in ``max_loras`` slots, and
the step's per-token slot index that the model's layers read.

The engine computes q, k and v in one GEMM (``qkv_proj``) and gate and up in another
(``gate_up_proj``), as vLLM's ``MergedColumnParallelLinearWithLoRA``. Their adapters stack the
same way: a slot's A is its parts' A's one above the other ([S * r, in]: one shrink for all S
parts) and its B places each part's B in that part's output rows and rank columns ([out, S * r],
zero elsewhere: one expand). A part the adapter leaves alone stays zero.

``LoRABatch.token_slots`` is a fixed device buffer (CUDA graphs read its first T entries); the
forward pass sorts the tokens by slot once (``begin``) and every layer reuses that order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vllm_actors.kernels.lora import LoRAMetadata, add_lora, lora_metadata


class LoRABatch:
    """The step's slot per token (-1: no adapter) and its metadata, shared by every layer."""

    def __init__(self, max_tokens: int, num_slots: int, device: torch.device) -> None:
        self.token_slots = torch.full((max_tokens,), -1, dtype=torch.int32, device=device)
        self.num_slots = num_slots
        self.meta: LoRAMetadata | None = None

    def begin(self, num_tokens: int) -> None:
        """Called by the model at the start of each forward pass of ``num_tokens`` tokens."""
        self.meta = lora_metadata(self.token_slots[:num_tokens], self.num_slots)


class FusedLoRA:
    """One fused projection of one layer: ``a`` [L, S * r, in], ``b`` [L, out, S * r]."""

    def __init__(self, num_slots: int, rank: int, in_features: int, out_parts: Sequence[int],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.rank = rank
        self.row_bounds = [sum(out_parts[:index]) for index in range(len(out_parts) + 1)]
        stacked = rank * len(out_parts)
        self.a = torch.zeros((num_slots, stacked, in_features), dtype=dtype, device=device)
        self.b = torch.zeros((num_slots, self.row_bounds[-1], stacked), dtype=dtype, device=device)

    def write(self, slot: int, parts: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot ``slot`` holds these parts' (A [r_i, in], B [out_i, r_i]) now (None: part not adapted)."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for index, part in enumerate(parts):
            if part is None:
                continue
            a, b = part
            rank, cols = a.shape[0], index * self.rank
            rows = slice(self.row_bounds[index], self.row_bounds[index + 1])
            self.a[slot, cols : cols + rank].copy_(a, non_blocking=True)
            self.b[slot, rows, cols : cols + rank].copy_(b, non_blocking=True)


class LayerLoRA:
    """What a layer calls after a projection: ``add(name, x, y)`` adds each token's adapter product."""

    def __init__(self, batch: LoRABatch, modules: dict[str, FusedLoRA]) -> None:
        self.batch = batch
        self.modules = modules

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        module = self.modules.get(name)
        meta = self.batch.meta
        if module is not None and meta is not None:
            add_lora(x, y, module.a, module.b, meta)
