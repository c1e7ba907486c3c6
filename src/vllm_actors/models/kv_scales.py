"""An fp8 KV cache's per-layer scales in a checkpoint: which tensor names hold them (the names vLLM's
``maybe_remap_kv_scale_name`` accepts) and their values; the attention layers' scales set from them
(``KvScaleSetup``, mixed into ``CausalLM``)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import structlog
import torch
from torch import nn

from vllm_actors.kernels import kv_quant

if TYPE_CHECKING:
    from collections.abc import Sequence

    from vllm_actors.models.config import ModelConfig
    from vllm_actors.models.pipeline import PipelineStage

log = structlog.get_logger(__name__)

# model.layers.N.self_attn.k_scale / .v_scale (llm-compressor, quark), under k_proj / v_proj
# (ModelOpt) or qkv_proj or attn, and the older single .kv_scale (used for both k and v, as vLLM does).
_SCALE_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj|qkv_proj|attn)\.)?(k_scale|v_scale|kv_scale)$"
)


class ScaleSource(Protocol):
    def read(self, name: str, part: None) -> torch.Tensor: ...


class ScaledAttention(Protocol):
    """An attention layer's KV scales (``models/llama.py``'s ``Attention``)."""

    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    calculate_kv_scales: bool


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


class KvScaleSetup(nn.Module):
    """The KV scales of ``CausalLM``'s attention layers (``CausalLM`` mixes this in)."""

    if TYPE_CHECKING:  # provided by CausalLM
        config: ModelConfig
        stage: PipelineStage
        checkpoint_kv_scales: dict[int, dict[str, float]]
        kv_cache_dtype: torch.dtype | None

        def attention_layers(self) -> Sequence[ScaledAttention]: ...

    def init_kv_scales(self, kv_cache_dtype: torch.dtype, calculated: bool = False) -> None:
        """Give every layer the scales of a cache of ``kv_cache_dtype``: none for the model's own
        dtype; for e4m3 the checkpoint's, else 1.0 (vLLM's default; ``calculated``: until the first
        step sets them, so no warning); for e5m2 always 1.0."""
        self.kv_cache_dtype = kv_cache_dtype
        if not kv_quant.is_fp8(kv_cache_dtype):
            for attn in self.attention_layers():
                attn.k_scale = attn.v_scale = None
            return
        device = next(self.parameters()).device
        from_checkpoint = self.checkpoint_kv_scales if kv_quant.has_scales(kv_cache_dtype) else {}
        if kv_quant.has_scales(kv_cache_dtype) and not from_checkpoint and not calculated:
            log.warning("kv_scales_default", kv_cache_dtype=str(kv_cache_dtype), k_scale=1.0, v_scale=1.0,
                        note="the checkpoint has no k_scale/v_scale: calculate_kv_scales can set them")
        elif self.checkpoint_kv_scales and not from_checkpoint:
            log.info("kv_scales_ignored", kv_cache_dtype=str(kv_cache_dtype), note="fp8_e5m2 takes no scales")
        for index, attn in zip(self.stage.layers(self.config.num_hidden_layers), self.attention_layers(), strict=True):
            given = from_checkpoint.get(index, {})
            attn.k_scale, attn.v_scale = kv_quant.kv_scale_tensors(device, given.get("k", 1.0), given.get("v", 1.0))

    def calculate_kv_scales(self) -> None:
        """The next forward sets every layer's KV scales from its own k and v (vLLM's
        calculate_kv_scales); nothing without an e4m3 cache (init_kv_scales first)."""
        calculate = self.kv_cache_dtype is not None and kv_quant.has_scales(self.kv_cache_dtype)
        for attn in self.attention_layers():
            attn.calculate_kv_scales = calculate
