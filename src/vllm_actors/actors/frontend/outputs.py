"""What ``LLM.generate`` returns, with vLLM's class and attribute names, and the deltas the
frontend sends its client for a streamed request (``OutputDelta``: only what is new)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen/actual token and the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sequence of a request's output, cumulative. The outputs streamed for one request share
    their ``token_ids`` and ``logprobs`` lists, which grow as tokens come (as in vLLM V1): copy
    them to keep a snapshot of an unfinished output."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (vLLM's RequestOutput field)
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionDelta:
    """What one update adds to one sequence: its new text, token ids and their logprobs (None:
    not asked for), with the sequence's state after the update."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class PromptPart:
    """The prompt of a request, sent once, in its first ``OutputDelta``."""

    prompt: str | None
    token_ids: list[int]


@dataclass(slots=True)
class OutputDelta:
    """The frontend's message to its client about one request after one update: what is new since
    the request's previous delta, so that a long stream costs O(n) in all. ``prompt`` is set in
    the first delta only; ``prompt_logprobs`` holds the positions computed since the last one."""

    request_id: str
    outputs: list[CompletionDelta]  # one per sequence (n), in index order
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    prompt: PromptPart | None = None
    prompt_logprobs: list[tuple[int, PositionLogprobs]] | None = None  # (prompt position, logprobs)

