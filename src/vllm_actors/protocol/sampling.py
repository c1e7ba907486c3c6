"""Sampling parameters: part of the wire contract (imports nothing of the project).

Names and defaults follow vLLM's ``SamplingParams`` so code written for vLLM works unchanged.
Every invalid value raises a ``ValueError`` naming the field, at construction time, before any
request is queued. Integers are bounded so that every value fits the wire (msgpack: 64 bits) and
no request can make the engine loop or allocate without end: ``seed`` over signed 64 bits (as
vLLM's OpenAI server: -1 is a seed like any other), ``n`` at most ``MAX_N``, token counts, ``top_k``
and token ids at most ``MAX_INT32``.
"""

from __future__ import annotations

import math

import msgspec

# Temperatures below this are treated as greedy, like vLLM does, to avoid dividing by ~0.
_GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20  # the OpenAI server's default --max-logprobs (vLLM's); SamplingParams takes any count or -1
MAX_N = 1024  # completions per request (OpenAI allows 128; the frontend builds one child request each)
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1  # a signed 64-bit integer, like vLLM's (torch.long)
MAX_INT32 = 2**31 - 1  # token counts, top_k, token ids: far beyond any model, and within every tensor dtype


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, frozen=True):
    """A constraint on the output (vLLM's ``StructuredOutputsParams``): exactly one kind is set.

    ``json`` is a JSON schema, serialised (``"{}"`` or ``json_object`` for any JSON object);
    ``grammar`` is an EBNF grammar (the backend's dialect, GBNF-like); ``choice`` lists the only
    outputs allowed. ``start_after``: the output is free until this token is drawn (vLLM's
    structured outputs after the reasoning)."""

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # the constraint applies after this token (a reasoning model's end of reasoning); None: from the start
    start_after: int | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs: set exactly one of json, regex, choice, grammar, json_object; "
                f"got {kinds or 'none'}"
            )
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice: must be a non-empty list of strings")
        for name in ("json", "regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name}: must be a string, got {getattr(self, name)!r}"[:300])
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object: must be a bool, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        )


StructuredOutputsParams = StructuredOutputs  # vLLM's name (vllm.sampling_params.StructuredOutputsParams)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None
    # vLLM's sampling controls (applied on the logits before the draw, in vLLM's order)
    presence_penalty: float = 0.0  # [-2, 2], over output tokens
    frequency_penalty: float = 0.0  # [-2, 2], over output tokens
    repetition_penalty: float = 1.0  # > 0, over prompt and output tokens
    logit_bias: dict[int, float] | None = None  # token id -> bias, clamped to [-100, 100] when applied
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    bad_words_token_ids: list[list[int]] = []  # the frontend tokenises bad_words into these

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # vLLM accepts a single string
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check_int("n", self.n, minimum=1, maximum=MAX_N)
        _check_number("temperature", self.temperature, minimum=0.0)
        _check_number("top_p", self.top_p, minimum=0.0, maximum=1.0)
        if self.top_p == 0.0:
            raise ValueError("top_p must be in (0, 1], got 0.0")
        _check_int("top_k", self.top_k, minimum=0, maximum=MAX_INT32)
        _check_number("min_p", self.min_p, minimum=0.0, maximum=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=MIN_SEED, maximum=MAX_SEED)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, minimum=1, maximum=MAX_INT32)
        _check_int("min_tokens", self.min_tokens, minimum=0, maximum=MAX_INT32)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens}, "
                f"max_tokens={self.max_tokens}"
            )
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, minimum=0, maximum=MAX_INT32)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value != -1:  # -1: the whole vocabulary (vLLM's)
                _check_int(name, value, minimum=0, maximum=MAX_INT32)
        self._validate_controls()
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

    def _validate_controls(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), minimum=-2.0, maximum=2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            for token_id, bias in self.logit_bias.items():
                _check_int("logit_bias", token_id, minimum=0, maximum=MAX_INT32)
                _check_number("logit_bias", bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            for token_id in self.allowed_token_ids:
                _check_int("allowed_token_ids", token_id, minimum=0, maximum=MAX_INT32)
        if not isinstance(self.bad_words, list) or not all(isinstance(w, str) for w in self.bad_words):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        if not isinstance(self.bad_words_token_ids, list):
            raise ValueError("bad_words_token_ids must be a list of lists of token ids")
        for word in self.bad_words_token_ids:
            if not isinstance(word, list) or not word:
                raise ValueError("bad_words_token_ids must be a list of non-empty lists of token ids")
            for token_id in word:
                _check_int("bad_words_token_ids", token_id, minimum=0, maximum=MAX_INT32)

    @property
    def has_controls(self) -> bool:
        """Whether any of vLLM's logits controls is set (penalties, logit_bias, allowed_token_ids,
        bad words): rows without them skip that step of the sampler."""
        return bool(
            self.has_penalties or self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
        )

    @property
    def has_penalties(self) -> bool:
        """Whether a presence, frequency or repetition penalty is set (they read the prompt and the
        tokens generated so far)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE

    def clone(self, **changes: object) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)

    def child_seed(self, index: int) -> int | None:
        """The seed of the ``index``-th of ``n`` completions: ``seed + index``, wrapped around within
        the signed 64-bit range (so a seed near the top stays a valid seed)."""
        if self.seed is None:
            return None
        return (self.seed + index - MIN_SEED) % 2**64 + MIN_SEED


def _check_int(name: str, value: object, minimum: int | None = None, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")


def _check_number(name: str, value: object, minimum: float | None = None, maximum: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
