"""The mixture-of-experts architectures: their Hugging Face names, the config fields they add to
``ModelConfig`` and the checkpoint names of their experts. Torch-free (``config.py`` imports it).

Both run the Llama/Qwen3 decoder of ``models/llama.py`` with ``models/moe.py``'s sparse MLP block in
their MoE layers:

- Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norms); ``num_experts`` experts of
  ``moe_intermediate_size``, ``num_experts_per_tok`` of them per token, the top-k softmax
  probabilities renormalised when ``norm_topk_prob``; layer ``i`` is sparse unless it is in
  ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (a dense MLP of ``intermediate_size``).
- Mixtral (``MixtralForCausalLM``): Llama's attention; ``num_local_experts`` experts of
  ``intermediate_size`` in every layer, top-k (2) of the softmax always renormalised.
"""

from __future__ import annotations

import re
from typing import Any, Literal

# Hugging Face architecture -> model_type: what the model registry maps to models/llama.py's CausalLM
MOE_ARCHITECTURES: dict[str, str] = {"Qwen3MoeForCausalLM": "qwen3_moe", "MixtralForCausalLM": "mixtral"}

# A checkpoint's expert tensors: model.layers.{i}.{block}.experts.{e}.{projection}.weight, where
# block and projection names differ by family (Mixtral: w1 gate, w3 up, w2 down).
EXPERT_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe"}
EXPERT_PROJECTIONS = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}
_EXPERT_NAME = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$")


def moe_fields(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """``ModelConfig``'s MoE fields from a config.json of ``model_type`` (one of MOE_ARCHITECTURES' values)."""
    layers = int(config["num_hidden_layers"])
    if model_type == "mixtral":
        experts = config.get("num_local_experts")
        inter = int(config["intermediate_size"])
        renormalize, sparse = True, tuple(range(layers))
        window = config.get("sliding_window")
        if window is not None and int(window) < int(config.get("max_position_embeddings", 0)):
            raise ValueError(f"Mixtral with sliding_window {window} is not supported (attention here sees the "
                             "whole context); supported: sliding_window null")
    elif model_type == "qwen3_moe":
        experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 writes the latter
        inter = int(config["moe_intermediate_size"])
        renormalize = bool(config.get("norm_topk_prob", False))
        given_step = config.get("decoder_sparse_step")
        step = 1 if given_step is None else int(given_step)
        dense = set(config.get("mlp_only_layers") or [])
        if step < 1:
            raise ValueError(f"decoder_sparse_step must be at least 1, got {step}")
        sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        if config.get("use_sliding_window"):
            raise ValueError("Qwen3-MoE with use_sliding_window true is not supported; supported: false")
    else:
        raise ValueError(f"{model_type!r} is not a mixture-of-experts model_type; supported: "
                         f"{', '.join(MOE_ARCHITECTURES.values())}")
    if experts is None:
        raise ValueError(f"{model_type} config.json lacks the number of experts (num_experts or num_local_experts)")
    experts, top_k = int(experts), int(config.get("num_experts_per_tok", 0))
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({experts})")
    return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                norm_topk_prob=renormalize, moe_layers=sparse)


def expert_split(name: str) -> Literal["column", "row"] | None:
    """How a tensor-parallel rank splits the checkpoint tensor ``name`` if it is an expert's:
    gate and up by output rows ("column"), down by input columns ("row"); None for any other."""
    found = _EXPERT_NAME.search(name.removesuffix(".weight"))
    if found is None:
        return None
    return "row" if found.group(1) in ("down_proj", "w2") else "column"
