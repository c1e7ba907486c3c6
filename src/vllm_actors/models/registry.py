"""The one table of supported model architectures: Hugging Face architecture name -> the module and
class that build it.

A checkpoint's `config.json` names its class in `architectures[0]` (and its family in
`model_type`); `resolve` maps either to an entry, `model_class` imports the class lazily. This
module must not import torch: the scheduler and the frontend read the config too.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelEntry:
    """One supported architecture."""

    architecture: str  # config.json `architectures[0]`, e.g. "LlamaForCausalLM"
    model_type: str  # config.json `model_type`; ModelConfig.architecture holds it
    module: str  # the module whose `class_name` builds the model
    class_name: str
    gguf: bool  # also read from a .gguf file (`general.architecture` == model_type)
    summary: str  # one line for `vllm-actors models` and docs/models.md


_DENSE = "vllm_actors.models.llama"

# One line per architecture, kept in this order in the CLI listing and the docs table.
MODELS: tuple[ModelEntry, ...] = (
    ModelEntry("LlamaForCausalLM", "llama", _DENSE, "CausalLM", True, "Llama 2/3/3.1 (rope scaling per rope_type)"),
    ModelEntry("Qwen3ForCausalLM", "qwen3", _DENSE, "CausalLM", True, "Qwen3 dense (RMSNorm on q and k per head)"),
    ModelEntry("Qwen2ForCausalLM", "qwen2", _DENSE, "CausalLM", False, "Qwen2, Qwen2.5 (q/k/v bias)"),
    ModelEntry("MistralForCausalLM", "mistral", _DENSE, "CausalLM", False, "Mistral (sliding window where set)"),
    ModelEntry(
        "Gemma2ForCausalLM", "gemma2", _DENSE, "CausalLM", False,
        "Gemma 2 (soft caps, alternate sliding layers, scaled embedding, (1 + w) norms)",
    ),
    ModelEntry(
        "Gemma3ForCausalLM", "gemma3_text", _DENSE, "CausalLM", False,
        "Gemma 3 text (q/k norms, 5 sliding : 1 global layers, two rotary bases)",
    ),
    ModelEntry("Phi3ForCausalLM", "phi3", _DENSE, "CausalLM", False,
               "Phi-3 (fused qkv_proj and gate_up_proj; sliding window where set)"),
    ModelEntry(
        "Qwen3MoeForCausalLM", "qwen3_moe", _DENSE, "CausalLM", False,
        "Qwen3 mixture of experts (top-k of num_experts, norm_topk_prob; fused MoE kernel)",
    ),
    ModelEntry(
        "MixtralForCausalLM", "mixtral", _DENSE, "CausalLM", False,
        "Mixtral (top-2 of 8 experts, renormalised; fused MoE kernel)",
    ),
)


def entries() -> tuple[ModelEntry, ...]:
    return MODELS


def supported_architectures() -> list[str]:
    """Hugging Face architecture names, in table order."""
    return [entry.architecture for entry in MODELS]


def gguf_model_types() -> list[str]:
    """The `general.architecture` values a .gguf file may carry."""
    return [entry.model_type for entry in MODELS if entry.gguf]


def _unsupported(what: str) -> ValueError:
    return ValueError(
        f"unsupported model: {what}; supported architectures: {', '.join(supported_architectures())} "
        "(see `vllm-actors models`)"
    )


def entry_for_model_type(model_type: str) -> ModelEntry:
    for entry in MODELS:
        if entry.model_type == model_type:
            return entry
    raise _unsupported(f"model_type={model_type!r}")


def resolve(config: dict[str, Any]) -> ModelEntry:
    """The entry for a Hugging Face config.json: the first of `architectures` in the table, else
    its `model_type` when it names no architecture. A config that lists architectures of which
    none is supported is refused even when its `model_type` is known (a multimodal wrapper such as
    a `...ForConditionalGeneration` shares its text model's model_type)."""
    archs: Sequence[str] = config.get("architectures") or []
    model_type = config.get("model_type")
    by_name = {entry.architecture: entry for entry in MODELS}
    for arch in archs:
        if arch in by_name:
            return by_name[arch]
    if archs or not isinstance(model_type, str):
        raise _unsupported(f"model_type={model_type!r}, architectures={list(archs)}")
    return entry_for_model_type(model_type)


def model_class(model_type: str) -> type:
    """The torch module class that builds a model of ``model_type`` (imported here, lazily)."""
    entry = entry_for_model_type(model_type)
    cls = getattr(importlib.import_module(entry.module), entry.class_name)
    if not isinstance(cls, type):
        raise TypeError(f"{entry.module}.{entry.class_name} is not a class")
    return cls


def markdown_table() -> str:
    """The supported architectures as a Markdown table (docs/models.md holds its output)."""
    lines = ["| architecture | model_type | GGUF | notes |", "| --- | --- | --- | --- |"]
    for entry in MODELS:
        lines.append(
            f"| `{entry.architecture}` | `{entry.model_type}` | {'yes' if entry.gguf else 'no'} | {entry.summary} |"
        )
    return "\n".join(lines) + "\n"
