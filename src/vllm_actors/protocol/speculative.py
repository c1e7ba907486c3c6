"""Speculative decoding's configuration in vLLM's keys (``speculative_config={"method": ...}``).

Methods: ``ngram`` (prompt lookup: drafts copied from earlier in the request's own tokens),
``draft_model`` (a smaller model of the same vocabulary at ``model``, run by the worker; vLLM's
spelling without ``method`` means it too) and ``eagle3`` (an EAGLE-3 head at ``model``, run by the
worker over the target's hidden states). ``oracle`` is for benchmarks only (refused unless
``VLLM_ACTORS_ALLOW_ORACLE_DRAFTER`` is set: ``engine_args``): it replays given greedy
continuations, each drafted token right with the probability ``oracle_acceptance``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3")
ORACLE = "oracle"  # benchmarks only: not among the methods a bad dict's error offers
WORKER_METHODS = ("draft_model", "eagle3")  # drafted in the worker, beside the target
MAX_SPECULATIVE_TOKENS = 32
# A drafted token the worker proposes (draft_model): the plan says how many, the worker fills them in.
WORKER_DRAFT = -1
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
         "draft_tensor_parallel_size", "oracle_tokens", "oracle_acceptance", "oracle_seed")
_ORACLE_KEYS = ("oracle_tokens", "oracle_acceptance", "oracle_seed")
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
    # The oracle (benchmarks): (prompt ids, that prompt's greedy continuation) pairs, the chance
    # that each drafted token is the continuation's, and the seed of those draws.
    oracle_tokens: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()
    oracle_acceptance: float = 0.0
    oracle_seed: int = 0


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
    if method not in (*SPECULATIVE_METHODS, ORACLE):
        raise ValueError(f"speculative_config['method'] must be one of {SPECULATIVE_METHODS}, got {method!r}")
    if method != ORACLE and any(key in config for key in _ORACLE_KEYS):
        raise ValueError(f"speculative_config: {list(_ORACLE_KEYS)} are for method 'oracle', not {method!r}")
    model = config.get("model")
    if method == ORACLE:
        return _oracle_config(config, adaptive)
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


def _oracle_config(config: Mapping[str, Any], adaptive: bool) -> SpeculativeConfig:
    """The oracle drafter's keys checked: ``oracle_tokens`` a list of ``[prompt_ids, continuation_ids]``
    pairs, ``oracle_acceptance`` a number from 0 to 1, ``oracle_seed`` an integer."""
    unused = sorted(key for key in ("model", "prompt_lookup_max", "prompt_lookup_min") if key in config)
    if unused:
        raise ValueError(f"speculative_config: method 'oracle' takes no {unused}")
    pairs = config.get("oracle_tokens", ())
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(pair, (list, tuple)) and len(pair) == 2 and all(_token_ids(ids) for ids in pair)
            for pair in pairs):
        raise ValueError("speculative_config['oracle_tokens'] must be a list of [prompt_token_ids, "
                         "greedy_continuation_ids] pairs of non-negative integer lists")
    acceptance = config.get("oracle_acceptance")
    if isinstance(acceptance, bool) or not isinstance(acceptance, (int, float)) or not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"speculative_config['oracle_acceptance'] must be a number from 0 to 1, got {acceptance!r}")
    seed = config.get("oracle_seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"speculative_config['oracle_seed'] must be an integer, got {seed!r}")
    k = _positive(config, "num_speculative_tokens", None, MAX_SPECULATIVE_TOKENS)
    tokens = tuple((tuple(prompt), tuple(continuation)) for prompt, continuation in pairs)
    return SpeculativeConfig(method=ORACLE, num_speculative_tokens=k, adaptive=adaptive, oracle_tokens=tokens,
                             oracle_acceptance=float(acceptance), oracle_seed=seed)


def _token_ids(ids: object) -> bool:
    return isinstance(ids, (list, tuple)) and all(
        isinstance(token, int) and not isinstance(token, bool) and token >= 0 for token in ids)
