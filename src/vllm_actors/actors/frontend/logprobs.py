"""The scheduler's logprob entries as vLLM's ``Logprob`` dicts, each token's text decoded once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_actors.actors.frontend.outputs import Logprob, PositionLogprobs
from vllm_actors.protocol.messages import Logprobs

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer


class LogprobTexts:
    """Logprob entries to ``PositionLogprobs``, with a cache of decoded tokens (at most the
    vocabulary): a position with the whole vocabulary (logprobs -1) then costs lookups."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def position(self, entry: Logprobs) -> PositionLogprobs:
        result: PositionLogprobs = {}
        texts = self._texts_of(entry.token_ids)
        for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks, strict=True):
            if token_id in result:
                continue
            result[token_id] = Logprob(logprob=logprob if math.isfinite(logprob) else -math.inf, rank=rank,
                                       decoded_token=texts.get(token_id))
        return result

    def _texts_of(self, token_ids: Sequence[int]) -> dict[int, str]:
        if self.tokenizer is None:
            return {}
        cache = self._texts
        for token_id in token_ids:
            if token_id not in cache:
                cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return cache
