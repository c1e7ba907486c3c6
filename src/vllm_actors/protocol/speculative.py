"""Speculative decoding's configuration in vLLM's keys (``speculative_config={"method": ...}``).

Methods: ``ngram`` (prompt lookup: drafts copied from earlier in the request's own tokens),
``draft_model`` (a smaller model of the same vocabulary at ``model``, run by the worker; vLLM's
spelling without ``method`` means it too) and ``eagle3`` (an EAGLE-3 head at ``model``, run by the
worker over the target's hidden states).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")
WORKER_METHODS = ("draft_model", "eagle3")  # drafted in the worker, beside the target
MAX_SPECULATIVE_TOKENS = 32
# A drafted token the worker proposes (draft_model): the plan says how many, the worker fills them in.
WORKER_DRAFT = -1
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "draft_tensor_parallel_size")
_DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min/max when neither is given


class SpeculativeConfig(msgspec.Struct, kw_only=True, frozen=True):
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = _DEFAULT_LOOKUP
    prompt_lookup_min: int = _DEFAULT_LOOKUP
    model: str | None = None
    # Drafts per step chosen from the step cost model and the observed acceptance (False: always
    # num_speculative_tokens where a draft is found; VLLM_ACTORS_SPEC_ADAPTIVE=0, for tests).
    adaptive: bool = True


def _positive(config: Mapping[str, Any], name: str, default: int | None, upper: int) -> int:
    value = config.get(name, default)
    if value is None:
        raise ValueError(f"speculative_config needs {name!r} (an integer from 1 to {upper})")
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
        raise ValueError(f"speculative_config[{name!r}] must be an integer from 1 to {upper}, got {value!r}")
    return value


def parse_speculative_config(config: Mapping[str, Any] | SpeculativeConfig, adaptive: bool = True) -> SpeculativeConfig:
    """The dict of ``LLM(speculative_config=...)`` / ``--speculative-config JSON``, checked: a
    ``ValueError`` says what is wrong and what is allowed."""
    if isinstance(config, SpeculativeConfig):
        return config
    if not isinstance(config, Mapping):
        raise ValueError(f"speculative_config must be a dict (JSON object), got {type(config).__name__}")
    unknown = sorted(set(config) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config has unknown keys {unknown}; allowed: {list(_KEYS)}")
    method = config.get("method")
    if method is None and config.get("model") is not None:
        method = "draft_model"  # vLLM: a model without a method is a draft model
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"speculative_config['method'] must be one of {SPECULATIVE_METHODS}, got {method!r}")
    model = config.get("model")
    if method == "ngram":
        if model is not None:
            raise ValueError("speculative_config: method 'ngram' takes no 'model'")
        given_max, given_min = config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
        lookup_max = _positive(config, "prompt_lookup_max", given_min or _DEFAULT_LOOKUP, 1024)
        lookup_min = _positive(config, "prompt_lookup_min", given_max or _DEFAULT_LOOKUP, 1024)
        if lookup_min > lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lookup_min}) must not exceed "
                             f"prompt_lookup_max ({lookup_max})")
        k = _positive(config, "num_speculative_tokens", None, MAX_SPECULATIVE_TOKENS)
        return SpeculativeConfig(method=method, num_speculative_tokens=k, prompt_lookup_max=lookup_max,
                                 prompt_lookup_min=lookup_min, adaptive=adaptive)
    if not isinstance(model, str) or not model:
        raise ValueError(f"speculative_config: method {method!r} needs 'model', the path of the draft checkpoint")
    if "prompt_lookup_max" in config or "prompt_lookup_min" in config:
        raise ValueError(f"speculative_config: prompt_lookup_max/min are for method 'ngram', not {method!r}")
    if config.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("speculative_config['draft_tensor_parallel_size'] must be 1: the draft runs unsharded, "
                         f"got {config['draft_tensor_parallel_size']!r}")
    k = _positive(config, "num_speculative_tokens", 1 if method == "eagle3" else None, MAX_SPECULATIVE_TOKENS)
    return SpeculativeConfig(method=method, num_speculative_tokens=k, model=model, adaptive=adaptive)
