"""Request fields checked with vLLM 0.26's own error texts, where its tests read them: the seed's
signed 64-bit bound (pydantic's message, as vLLM's validation handler prints it) and logit_bias,
every bad key named (keys that are no integer, then token ids out of the vocabulary)."""

from __future__ import annotations

from vllm_actors.actors.frontend.controls import logit_bias_vocab_error
from vllm_actors.protocol.sampling import MAX_SEED, MIN_SEED
from vllm_actors.server.errors import OpenAIError, bad_request

MAX_ERROR_CHARS = 1000  # the keys quoted in an error: a body can hold many


def check_seed(seed: int | None) -> None:
    """vLLM's ``Field(ge=-2**63, le=2**63 - 1)``: a 400 as its validation handler words it."""
    if seed is None or MIN_SEED <= seed <= MAX_SEED:
        return
    kind, bound, words, name = (("less_than_equal", MAX_SEED, "less than", "le") if seed > MAX_SEED
                                else ("greater_than_equal", MIN_SEED, "greater than", "ge"))
    error = {"type": kind, "loc": ("body", "seed"), "msg": f"Input should be {words} or equal to {bound}",
             "input": seed, "ctx": {name: bound}}
    raise OpenAIError(f"1 validation error:\n  {error}", 400, param="seed")


def logit_bias_of(raw: dict[str, float] | None, vocab_size: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON object keys, strings) -> {id: bias}. A 400 names every
    key that is no integer, else every id outside ``[0, vocab_size)`` (vLLM's texts)."""
    if not raw:
        return None
    bias: dict[int, float] = {}
    invalid: list[str] = []
    for key, value in raw.items():
        try:
            bias[int(key)] = value
        except ValueError:
            invalid.append(key)
    if invalid:
        raise bad_request(f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                          f"{invalid!r}"[:MAX_ERROR_CHARS], "logit_bias")
    if vocab_size is not None:
        error = logit_bias_vocab_error(list(bias), vocab_size)
        if error is not None:
            raise bad_request(error[:MAX_ERROR_CHARS], "logit_bias")
    return bias

