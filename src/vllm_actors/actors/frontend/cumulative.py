"""The client's side of the frontend's deltas: each request's cumulative ``RequestOutput``,
assembled by appending.

The frontend sends only what is new (``OutputDelta``); a client that hands out vLLM's cumulative
outputs keeps one growing token-id list and one growing logprob list per sequence, and the prompt
as received once. Each output it makes is a new ``RequestOutput`` sharing those lists: nothing
already received is copied again, so a stream of n tokens costs O(n) in all."""

from __future__ import annotations

from collections.abc import Iterable

from vllm_actors.actors.frontend.outputs import (
    CompletionOutput,
    OutputDelta,
    PositionLogprobs,
    RequestOutput,
)


class CumulativeOutputs:
    """Open requests' latest cumulative outputs; a request is forgotten once finished."""

    def __init__(self) -> None:
        self._latest: dict[str, RequestOutput] = {}

    def __len__(self) -> int:
        return len(self._latest)

    def add(self, delta: OutputDelta) -> RequestOutput:
        """The request's cumulative output after ``delta``; its first delta must carry the prompt."""
        last = self._latest.get(delta.request_id)
        if last is None:
            if delta.prompt is None:
                raise ValueError(f"request {delta.request_id!r}: the first delta carries no prompt")
            last = RequestOutput(delta.request_id, delta.prompt.prompt, delta.prompt.token_ids, None, outputs=[])
        prompt_logprobs = last.prompt_logprobs
        if delta.prompt_logprobs:
            if prompt_logprobs is None:
                prompt_logprobs = [None] * len(last.prompt_token_ids)
            _place(prompt_logprobs, delta.prompt_logprobs)
        previous = {completion.index: completion for completion in last.outputs}
        outputs = []
        for change in delta.outputs:
            before = previous.get(change.index)
            if before is None:
                logprobs = list(change.logprobs) if change.logprobs is not None else None
                token_ids, text = list(change.token_ids), change.text
            else:
                token_ids, logprobs, text = before.token_ids, before.logprobs, before.text + change.text
                token_ids.extend(change.token_ids)
                if logprobs is not None and change.logprobs:
                    logprobs.extend(change.logprobs)
            outputs.append(CompletionOutput(change.index, text, token_ids, change.cumulative_logprob, logprobs,
                                            change.finish_reason, change.stop_reason))
        output = RequestOutput(delta.request_id, last.prompt, last.prompt_token_ids, prompt_logprobs, outputs,
                               finished=delta.finished, num_cached_tokens=delta.num_cached_tokens, error=delta.error)
        if delta.finished:
            self._latest.pop(delta.request_id, None)
        else:
            self._latest[delta.request_id] = output
        return output

    def add_all(self, deltas: Iterable[OutputDelta]) -> list[RequestOutput]:
        return [self.add(delta) for delta in deltas]

    def forget(self, request_id: str) -> None:
        """The request ended without a finished delta (aborted by the client)."""
        self._latest.pop(request_id, None)


def _place(into: list[PositionLogprobs | None], entries: list[tuple[int, PositionLogprobs]]) -> None:
    for position, logprobs in entries:
        into[position] = logprobs
