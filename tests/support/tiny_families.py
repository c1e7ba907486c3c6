"""Configs of the tiny dense-family checkpoints (`tiny_models.build_checkpoint`): transformers' own
config and model classes, with options set so each family's quirk shows in a few hundred tokens
(windows of 8 to 16 tokens, soft caps low enough to bend the scores, an attention scale that is not
head_dim's)."""

from __future__ import annotations

from typing import Any

FAMILIES = ("qwen2", "mistral", "gemma2", "gemma3_text", "phi3")

# The options per family; build_checkpoint's ``shape`` overrides them.
FAMILY_OPTIONS: dict[str, dict[str, Any]] = {
    # sliding on layers from max_window_layers on (transformers' rule), so both kinds are present
    "qwen2": {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1},
    "mistral": {"sliding_window": 8},
    "phi3": {"sliding_window": 10},  # its checkpoint fuses q/k/v and gate/up
    "gemma2": {
        "sliding_window": 8, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 5.0,
        "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
    },
    # (six layers, from the fixture: five sliding, then one global) a linear-scaled global rotary, a
    # plain local one; an attention soft cap that transformers' Gemma 3 ignores, so must we
    "gemma3_text": {
        "sliding_window": 16, "query_pre_attn_scalar": 24, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": 3.0, "final_logit_softcapping": 6.0,
    },
}


def family_config(arch: str, common: dict[str, Any], rope: dict[str, Any]) -> tuple[Any, type]:
    """(config, model class) of transformers for ``arch`` from build_checkpoint's common sizes."""
    import transformers

    if arch not in FAMILIES:
        raise ValueError(f"unknown arch {arch!r}; families: {FAMILIES}")
    options = {**FAMILY_OPTIONS[arch], **{k: v for k, v in common.items() if k in FAMILY_OPTIONS[arch]}}
    sizes = {k: v for k, v in common.items() if k not in options}
    if arch == "gemma3_text":
        sizes.pop("attention_bias", None)
        rope_parameters: dict[str, Any] = {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": rope["rope_theta"]},
        }
        config = transformers.Gemma3TextConfig(**sizes, **options, rope_parameters=rope_parameters)
        return config, transformers.Gemma3ForCausalLM
    classes = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    config = config_cls(**sizes, **options, rope_parameters=dict(rope))
    return config, model_cls
