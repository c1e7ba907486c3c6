"""Logprobs in OpenAI's and vLLM's shapes: legacy completions (``text_offset``, ``tokens``,
``token_logprobs``, ``top_logprobs``), chat (``content`` with ``top_logprobs``) and vLLM's
``prompt_logprobs`` (token id -> logprob, rank, decoded token). ``-inf`` is sent as -9999, as vLLM
does (JSON has no infinity); with ``as_ids`` tokens are spelled ``token_id:<id>``
(``return_tokens_as_token_ids``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from vllm_actors.actors.frontend.outputs import PositionLogprobs
from vllm_actors.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprob,
    TopLogprob,
)

LOGPROB_FLOOR = -9999.0  # what vLLM sends for -inf (JSON has no infinity)


def prompt_logprobs_body(positions: Sequence[PositionLogprobs | None] | None) -> PromptLogprobs | None:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or token id -> logprob, rank,
    decoded token (-inf as -9999, as vLLM clamps it)."""
    if positions is None:
        return None
    return [None if position is None else {
        token_id: PromptLogprob(logprob=_finite(entry.logprob), rank=entry.rank, decoded_token=entry.decoded_token)
        for token_id, entry in position.items()} for position in positions]


def _finite(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _token_text(entry: Any, token_id: int, as_id: bool = False) -> str:
    if as_id or entry.decoded_token is None:
        return f"token_id:{token_id}"
    return entry.decoded_token  # type: ignore[no-any-return]


def completion_logprobs(
    token_ids: Sequence[int],
    positions: Sequence[PositionLogprobs | None],
    text_offset: int,
    decode: Callable[[int], str],
    as_ids: bool = False,
) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs for ``token_ids`` (a position without logprobs - the first prompt
    token - gets None). Returns them and the text offset after the last token."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position else None
        text = _token_text(chosen, token_id, as_ids) if chosen is not None else decode(token_id)
        result.text_offset.append(text_offset)
        result.tokens.append(text)
        if chosen is None or position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            result.token_logprobs.append(_finite(chosen.logprob))
            result.top_logprobs.append({_token_text(e, i, as_ids): _finite(e.logprob) for i, e in position.items()})
        text_offset += len(text)
    return result, text_offset


def chat_logprobs(token_ids: Sequence[int], positions: Sequence[PositionLogprobs], top: int,
                  as_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat logprobs: the chosen token, then the top ``top`` (-1: all there are)."""
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id)
        if chosen is None:
            continue
        ranked = sorted(position.items(), key=lambda item: item[1].rank or 0)
        tops = [
            TopLogprob(token=_token_text(e, i, as_ids), logprob=_finite(e.logprob),
                       bytes=list(_token_text(e, i).encode("utf-8", errors="replace")))
            for i, e in (ranked if top < 0 else ranked[:top])
        ]
        text = _token_text(chosen, token_id, as_ids)
        content.append(TokenLogprob(token=text, logprob=_finite(chosen.logprob),
                                    bytes=list(_token_text(chosen, token_id).encode("utf-8", errors="replace")),
                                    top_logprobs=tops))
    return ChatLogprobs(content=content)
