"""The frontend's side of vLLM's sampling controls: bad words tokenised into token-id sequences
(as vLLM's ``SamplingParams.update_from_tokenizer``) and the controls' token ids checked against
the vocabulary, with a ``ValueError`` naming the field (a 400 in the server)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_actors.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer


def bad_words_token_ids(tokenizer: Tokenizer | None, bad_words: list[str]) -> list[list[int]]:
    """Each word without and with a leading space (to ban it at the start of the text and in the
    middle); the spaced form only when it makes a different first token and as many tokens."""
    if tokenizer is None:
        raise ValueError("bad_words: bad words need a tokenizer (skip_tokenizer_init=True)")
    sequences: list[list[int]] = []
    for word in bad_words:
        plain: list[int] | None = None
        for prefix in ("", " "):
            ids = tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
            if not ids:
                continue
            if plain is None:
                plain = ids
                sequences.append(ids)
            elif ids[0] != plain[0] and len(ids) == len(plain):
                sequences.append(ids)
    return sequences


def logit_bias_vocab_error(token_ids: list[int], vocab_size: int) -> str | None:
    """vLLM's text naming every logit_bias id outside ``[0, vocab_size)``; None: none is."""
    outside = [token_id for token_id in token_ids if token_id < 0 or token_id >= vocab_size]
    if not outside:
        return None
    return f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}"


def check_control_ids(params: SamplingParams, vocab_size: int) -> None:
    """Every token id of logit_bias, allowed_token_ids and bad words within the vocabulary."""
    error = logit_bias_vocab_error(list(params.logit_bias or {}), vocab_size)
    if error is not None:
        raise ValueError(error[:1000])
    fields = (
        ("allowed_token_ids", params.allowed_token_ids or []),
        ("bad_words", [token_id for word in params.bad_words_token_ids for token_id in word]),
    )
    for name, ids in fields:
        outside = [token_id for token_id in ids if token_id >= vocab_size]
        if outside:
            raise ValueError(f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab_size})")
