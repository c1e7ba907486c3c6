"""The engine arguments that size prefills for their neighbours, with vLLM's names and checks:
``long_prefill_token_threshold`` (a prompt with more tokens left than this is long; each step gives
a prefill at most this many tokens), ``max_num_partial_prefills`` and ``max_long_partial_prefills``
(how many prefills, and how many long ones, a step may carry at once when the first is above 1, as
vLLM's concurrent partial prefills), and ``itl_target_ms`` (the inter-token latency running decodes
are held to: a step's prefill tokens are sized by the step cost model to stay within it)."""

from __future__ import annotations

import math
from typing import Any

# vLLM's default threshold when concurrent partial prefills are on and none is given: 4% of
# max_model_len (vllm/config/scheduler.py).
DEFAULT_THRESHOLD_SHARE = 0.04


def long_prefill_error(config: Any) -> str | None:
    """What is wrong with these arguments of an ``EngineConfig`` (checks that need no model), or None."""
    threshold = config.long_prefill_token_threshold
    if not _is_int(threshold) or threshold < 0:
        return f"long_prefill_token_threshold must be an integer >= 0 (0: none), got {threshold!r}"
    partial, long = config.max_num_partial_prefills, config.max_long_partial_prefills
    if not _is_int(partial) or partial < 1:
        return f"max_num_partial_prefills ({partial!r}) must be greater than or equal to 1."
    if partial > 1 and not config.enable_chunked_prefill:
        return "Chunked prefill must be enabled to set max_num_partial_prefills > 1."
    if not _is_int(long) or not 1 <= long <= partial:
        return (f"max_long_partial_prefills ({long!r}) must be greater than or equal to 1 and less than or "
                f"equal to max_num_partial_prefills ({partial}).")
    target = config.itl_target_ms
    if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                               or not 0 < target < math.inf):
        return f"itl_target_ms must be a number of milliseconds > 0 (None: no target), got {target!r}"
    return None


def resolve_threshold(config: Any, max_model_len: int) -> int:
    """The threshold the scheduler uses: as given, or vLLM's 4% of ``max_model_len`` when concurrent
    partial prefills are on and none is given. Raises ValueError past ``max_model_len``."""
    threshold: int = config.long_prefill_token_threshold
    if config.max_num_partial_prefills > 1 and threshold == 0:
        threshold = max(1, int(max_model_len * DEFAULT_THRESHOLD_SHARE))
    if threshold > max_model_len:
        raise ValueError(f"long_prefill_token_threshold ({threshold}) cannot be greater than the "
                         f"max_model_len ({max_model_len}).")
    return threshold


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
