"""Checkpoints that store q/k/v and gate/up fused (Phi-3's ``self_attn.qkv_proj`` and
``mlp.gate_up_proj``), read under the per-projection names the model loads: ``q_proj`` is the first
``q_size`` rows of ``qkv_proj``, ``k_proj`` and ``v_proj`` the next ``kv_size`` each; ``gate_proj``
the first ``intermediate_size`` rows of ``gate_up_proj``, ``up_proj`` the rest. A part of one
(a tensor-parallel rank's rows) is read as those rows of the fused tensor alone."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from vllm_actors.models.config import ModelConfig
from vllm_actors.models.parallel import Part
from vllm_actors.models.tensor_source import TensorSource

_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


class SplitFusedSource:
    """``source`` with each fused projection tensor named as its parts (whole model sizes)."""

    def __init__(self, source: TensorSource, config: ModelConfig) -> None:
        self.source = source
        self._parts: dict[str, tuple[str, int, int]] = {}  # part name -> (fused name, first row, rows)
        sizes = {"self_attn.qkv_proj": [config.q_size, config.kv_size, config.kv_size],
                 "mlp.gate_up_proj": [config.intermediate_size] * 2}
        for name in source.names():
            module, _, kind = name.rpartition(".")
            fused = next((key for key in _FUSED if module.endswith("." + key)), None)
            if fused is None:
                continue
            if source.shape(name)[0] != sum(sizes[fused]):
                raise ValueError(f"{name}: {source.shape(name)[0]} rows, expected {sum(sizes[fused])} "
                                 f"({' + '.join(str(s) for s in sizes[fused])})")
            start = 0
            for part, rows in zip(_FUSED[fused], sizes[fused], strict=True):
                self._parts[f"{module.removesuffix(fused)}{part}.{kind}"] = (name, start, rows)
                start += rows
        self._fused = {fused for fused, _, _ in self._parts.values()}

    def names(self) -> Iterable[str]:
        return [name for name in self.source.names() if name not in self._fused] + list(self._parts)

    def shape(self, name: str) -> list[int]:
        if name not in self._parts:
            return self.source.shape(name)
        fused, _, rows = self._parts[name]
        return [rows, *self.source.shape(fused)[1:]]

    def read(self, name: str, part: Part | None) -> torch.Tensor:
        if name not in self._parts:
            return self.source.read(name, part)
        fused, first, rows = self._parts[name]
        full = self.source.shape(fused)[0]
        if part is None:
            return self.source.read(fused, Part(0, first, first + rows, full))
        if part.dim != 0:
            raise ValueError(f"{name}: a fused projection splits by rows, not columns")
        return self.source.read(fused, Part(0, first + part.start, first + part.stop, full))


def split_fused(source: TensorSource, config: ModelConfig) -> TensorSource:
    """``source`` itself when it holds no fused projection, else a ``SplitFusedSource`` of it."""
    fused = any(name.rpartition(".")[0].endswith(tuple("." + key for key in _FUSED)) for name in source.names())
    return SplitFusedSource(source, config) if fused else source
