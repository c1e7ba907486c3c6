"""RoPE scaling parameters as Hugging Face checkpoints write them, and the context they allow.

config.json spells rotary settings two ways: transformers 4 writes ``rope_theta`` and a
``rope_scaling`` dict, transformers 5 one ``rope_parameters`` dict holding ``rope_type`` and
``rope_theta``. Both read into one normalized dict (`normalize_rope_scaling`) that
``models/rope.py`` turns into frequencies. No torch here: the scheduler and the frontend import it.
"""

from __future__ import annotations

import math
from typing import Any

# The types the decoder computes (models/rope.py); "default" (plain rotary) normalizes to None.
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "yarn", "llama3")
_LLAMA3_FACTORS: tuple[str, ...] = ("factor", "low_freq_factor", "high_freq_factor")
# Types whose checkpoints already give the extended length as max_position_embeddings (vLLM's rule).
_UNSCALED_LIMIT_TYPES: tuple[str, ...] = ("llama3", "longrope", "su")


def rope_sources(config: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """(rope_theta, scaling dict) of a config.json in either spelling; the top-level keys win."""
    params = config.get("rope_parameters")
    params = params if isinstance(params, dict) else None
    theta = config.get("rope_theta")
    if theta is None and params is not None:
        theta = params.get("rope_theta")
    scaling = config.get("rope_scaling") or params
    return (None if theta is None else float(theta)), scaling


def normalize_rope_scaling(
    scaling: dict[str, Any] | None, max_position_embeddings: int, original_max_position_embeddings: int | None = None
) -> dict[str, Any] | None:
    """None for plain rotary, else a dict of the type's parameters with transformers' defaults filled
    in (``yarn``'s attention factor computed); an unsupported type or a missing key raises.

    ``original_max_position_embeddings``: a top-level config key of that name, which transformers
    prefers over the one inside the scaling dict."""
    if not scaling:
        return None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default", "none"):
        return None
    partial = scaling.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial rotary (partial_rotary_factor={partial}) is not supported: {scaling}")
    if rope_type in ("linear", "dynamic"):
        return {"rope_type": rope_type, "factor": _factor(scaling, rope_type)}
    original = int(original_max_position_embeddings or scaling.get("original_max_position_embeddings")
                   or max_position_embeddings)
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_FACTORS if k not in scaling]
        if missing:
            raise ValueError(f"llama3 rope scaling is missing {missing}: {scaling}")
        out: dict[str, Any] = {"rope_type": "llama3"}
        for key in _LLAMA3_FACTORS:
            out[key] = float(scaling[key])
        out["original_max_position_embeddings"] = original
        return out
    if rope_type == "yarn":
        return _yarn(scaling, max_position_embeddings, original)
    raise ValueError(
        f"unsupported rope scaling type {rope_type!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)}): {scaling}"
    )


def _factor(scaling: dict[str, Any], rope_type: str) -> float:
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or not factor > 0:
        raise ValueError(f"{rope_type} rope scaling needs a numeric factor > 0, got {factor!r}: {scaling}")
    return float(factor)


def _yarn(scaling: dict[str, Any], max_position_embeddings: int, original: int) -> dict[str, Any]:
    """transformers' ``_compute_yarn_parameters`` inputs: a missing factor is the ratio of the two
    lengths; the attention factor (vLLM's mscale, applied to cos and sin) follows from the factor."""
    factor = (_factor(scaling, "yarn") if scaling.get("factor") is not None
              else max_position_embeddings / original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    return {
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
        "beta_fast": float(scaling.get("beta_fast") or 32),
        "beta_slow": float(scaling.get("beta_slow") or 1),
        "attention_factor": float(attention_factor),
        "truncate": bool(scaling.get("truncate", True)),
    }


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def derived_max_model_len(max_position_embeddings: int, rope_scaling: dict[str, Any] | None) -> int:
    """The longest context the model's config allows (vLLM's ``_get_and_verify_max_len``):
    max_position_embeddings, times the scaling factor for rope types that stretch it (all but
    llama3 and longrope, whose max_position_embeddings is already the extended length); yarn scales
    its original_max_position_embeddings."""
    if not rope_scaling or rope_scaling["rope_type"] in _UNSCALED_LIMIT_TYPES:
        return int(max_position_embeddings)
    base = max_position_embeddings
    if rope_scaling["rope_type"] == "yarn":
        base = rope_scaling["original_max_position_embeddings"]
    return int(base * float(rope_scaling.get("factor", 1.0)))
