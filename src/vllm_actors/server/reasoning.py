"""Reasoning parsers, vLLM's ``--reasoning-parser qwen3`` and ``deepseek_r1``: the text a model writes
between ``<think>`` and ``</think>`` goes to the message's ``reasoning`` field (streamed as its own
``reasoning`` deltas), the rest to ``content``. Pure state machines (no sockets or clocks).

Both read the same tags, which must be tokens of the model's vocabulary (vLLM refuses the parser
otherwise). Their rules, as vLLM 0.26's: a ``<think>`` in the output is dropped with whatever came
before it; text before ``</think>`` is reasoning even without a ``<think>`` (the chat template
opened it); an output without ``</think>`` is all reasoning (cut short while thinking). qwen3 only:
with ``enable_thinking`` false (``chat_template_kwargs``, or ``reasoning_effort: "none"``) the
output is content. A prompt whose last tag is ``</think>`` (a template that closed the reasoning)
makes the whole output content.

Structured outputs and forced tool calls apply after the reasoning, as vLLM's: ``grammar_start``
is the token after which the worker starts the grammar (``StructuredOutputs.start_after``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START_TAG = "<think>"
END_TAG = "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """A server's parser: the tags' token ids in its model's vocabulary."""

    name: str
    start_id: int
    end_id: int

    @classmethod
    def create(cls, name: str, token_to_id: Callable[[str], int | None]) -> ReasoningParser:
        if name not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser: unknown parser {name!r}; allowed: {', '.join(REASONING_PARSERS)}")
        start_id, end_id = token_to_id(START_TAG), token_to_id(END_TAG)
        if start_id is None or end_id is None:
            raise ValueError(f"--reasoning-parser {name}: the model's tokenizer has no {START_TAG} and {END_TAG} "
                             "tokens (vLLM: could not locate think start/end tokens in the tokenizer)")
        return cls(name, start_id, end_id)

    def for_request(self, prompt_token_ids: Sequence[int], template_kwargs: Mapping[str, Any]) -> RequestReasoning:
        """One request's view: whether its prompt (or enable_thinking false, for qwen3) already ended
        the reasoning."""
        thinking = not (self.name == "qwen3" and template_kwargs.get("enable_thinking", True) is False)
        return RequestReasoning(self, ended_in_prompt=self._prompt_ends_reasoning(prompt_token_ids),
                                thinking=thinking)

    def _prompt_ends_reasoning(self, token_ids: Sequence[int]) -> bool:
        for token_id in reversed(token_ids):
            if token_id == self.start_id:
                return False
            if token_id == self.end_id:
                return True
        return False


@dataclass(frozen=True)
class RequestReasoning:
    parser: ReasoningParser
    ended_in_prompt: bool
    thinking: bool  # qwen3: enable_thinking (deepseek_r1: always)

    @property
    def all_content(self) -> bool:
        return self.ended_in_prompt or not self.thinking

    @property
    def grammar_start(self) -> int | None:
        """The token after which a constraint applies (None: from the first token)."""
        return None if self.all_content else self.parser.end_id

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none (vLLM's shapes)."""
        if self.ended_in_prompt:
            return None, text
        before, tag, after = text.partition(START_TAG)
        text = after if tag else before
        if END_TAG in text:
            reasoning, _, content = text.partition(END_TAG)
            return reasoning, content or None
        if not self.thinking:
            return None, text
        return text, None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, ended=self.all_content)


class ReasoningStream:
    """One choice's output, a step at a time: ``feed`` -> (reasoning, content) of the step's text,
    each None where the step has none; (None, None) for a step of tags only (no chunk, as vLLM)."""

    def __init__(self, parser: ReasoningParser, ended: bool) -> None:
        self._parser = parser
        self.ended = ended

    def feed(self, text: str, token_ids: Sequence[int]) -> tuple[str | None, str | None]:
        if self.ended:
            return None, text
        parser = self._parser
        if parser.start_id in token_ids:
            _, tag, after = text.partition(START_TAG)
            if tag:
                text = after
        if parser.end_id in token_ids:
            self.ended = True
            reasoning, tag, content = text.partition(END_TAG)
            if not tag:
                return None, None  # the tag's text was not in the step's (skipped as special)
            return reasoning or None, content or None
        if not text and token_ids and all(t == parser.start_id for t in token_ids):
            return None, None
        return text, None
