"""What each dense family adds to the Llama decoder, read from its Hugging Face config.json.

`family_fields` returns the `ModelConfig` fields a family sets beyond Llama's: Qwen2's q/k/v bias,
a sliding window and the layers it applies to (Mistral: every layer; Qwen2: from
`max_window_layers` when `use_sliding_window`; Gemma 2: every other layer; Gemma 3: five of six),
Gemma's soft caps, attention scale, GELU MLP, scaled embedding, (1 + w) norms with a norm before
and after each block, and Gemma 3's second rotary base for its sliding layers. No torch here.
"""

from __future__ import annotations

from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
GEMMA_TYPES = ("gemma2", "gemma3_text")
HIDDEN_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _layer_types(config: dict[str, Any], layers: int, default_sliding: list[bool]) -> list[str]:
    given = config.get("layer_types")
    if given is not None:
        if len(given) != layers or any(t not in (SLIDING, FULL) for t in given):
            raise ValueError(f"layer_types must list {layers} of {SLIDING!r}/{FULL!r}, got {given}")
        return [str(t) for t in given]
    return [SLIDING if sliding else FULL for sliding in default_sliding]


def _window(config: dict[str, Any]) -> int | None:
    window = config.get("sliding_window")
    return None if window is None else int(window)


def _gemma3_rope(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """(global theta, global scaling dict, local theta) in transformers 4's spelling (`rope_theta`,
    `rope_scaling`, `rope_local_base_freq`) or 5's (`rope_parameters` per layer type)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and FULL in params:
        full, local = dict(params[FULL] or {}), dict(params.get(SLIDING) or {})
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"Gemma 3's sliding layers take plain rotary only, got {local}")
        return float(full.get("rope_theta", 1_000_000.0)), full, float(local.get("rope_theta", 10_000.0))
    theta = float(config.get("rope_theta", 1_000_000.0))
    return theta, config.get("rope_scaling"), float(config.get("rope_local_base_freq", 10_000.0))


def family_fields(model_type: str, config: dict[str, Any]) -> dict[str, Any]:
    """The family's fields of `ModelConfig` (the defaults, Llama's, for llama and qwen3)."""
    layers = int(config["num_hidden_layers"])
    fields: dict[str, Any] = {}
    if model_type == "qwen2":
        fields["qkv_bias"] = True
        if config.get("use_sliding_window") and _window(config) is not None:  # as transformers: else no window
            first = int(config.get("max_window_layers", layers))
            types = _layer_types(config, layers, [i >= first for i in range(layers)])
            if SLIDING in types:
                fields.update(sliding_window=_window(config), layer_types=types)
    elif model_type in ("mistral", "phi3"):  # transformers' Mistral and Phi-3 window every layer
        if _window(config) is not None:
            fields.update(sliding_window=_window(config), layer_types=[SLIDING] * layers)
    elif model_type in GEMMA_TYPES:
        pattern = 2 if model_type == "gemma2" else int(config.get("sliding_window_pattern", 6))
        fields.update(
            sliding_window=_window(config),
            layer_types=_layer_types(config, layers, [(i + 1) % pattern != 0 for i in range(layers)]),
            # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never applies it
            attn_logit_softcapping=config.get("attn_logit_softcapping") if model_type == "gemma2" else None,
            final_logit_softcapping=config.get("final_logit_softcapping"),
            query_pre_attn_scalar=float(config.get("query_pre_attn_scalar", 256)),
            hidden_activation=str(config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"),
            gemma_norms=True,
            embed_scale=float(config["hidden_size"]) ** 0.5,
        )
        if config.get("use_bidirectional_attention"):
            raise ValueError(f"{model_type} with use_bidirectional_attention (an encoder) is not supported")
    if fields.get("hidden_activation", "silu") not in HIDDEN_ACTIVATIONS:
        raise ValueError(f"hidden_activation {fields['hidden_activation']!r}: supported {HIDDEN_ACTIVATIONS}")
    return fields


def rope_overrides(model_type: str, config: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float] | None:
    """Gemma 3's (global theta, global scaling, local theta); None for the families with one rotary."""
    return _gemma3_rope(config) if model_type == "gemma3_text" else None
