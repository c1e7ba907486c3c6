"""An fp8 KV cache's per-layer scales in a checkpoint: which tensor names hold them (the names vLLM's
``maybe_remap_kv_scale_name`` accepts) and their values."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Protocol

import structlog
import torch

log = structlog.get_logger(__name__)

# model.layers.N.self_attn.k_scale / .v_scale (llm-compressor, quark), under k_proj / v_proj
# (ModelOpt) or qkv_proj or attn, and the older single .kv_scale (used for both k and v, as vLLM does).
_SCALE_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj|qkv_proj|attn)\.)?(k_scale|v_scale|kv_scale)$"
)


class ScaleSource(Protocol):
    def read(self, name: str, part: None) -> torch.Tensor: ...


def is_kv_scale_name(name: str) -> bool:
    return _SCALE_NAME.match(name) is not None


def read_kv_scales(names: Iterable[str], source: ScaleSource, num_layers: int) -> dict[int, dict[str, float]]:
    """{layer: {"k": k_scale, "v": v_scale}} from the checkpoint tensors among ``names`` that hold
    KV scales (one value each: per-tensor scales)."""
    scales: dict[int, dict[str, float]] = {}
    for name in names:
        match = _SCALE_NAME.match(name)
        if match is None:
            continue
        layer, kind = int(match.group(1)), match.group(2)
        if layer >= num_layers:
            raise ValueError(f"{name}: the model has {num_layers} layers")
        tensor = source.read(name, None)
        if tensor.numel() != 1:
            raise ValueError(f"{name}: a KV scale must hold one value (per-tensor), got shape {tuple(tensor.shape)}")
        value = float(tensor.float().item())
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}: a KV scale must be positive and finite, got {value}")
        if kind == "kv_scale":
            log.warning("deprecated_kv_scale", name=name, note="used as both k_scale and v_scale, as vLLM does")
        for key in ("k", "v") if kind == "kv_scale" else (kind[0],):
            scales.setdefault(layer, {})[key] = value
    return scales
