"""``RequestStream``: the outputs of one request of an ``AsyncEngineClient``, as an async iterator."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import CompletionOutput, RequestOutput


class _Aborter(Protocol):
    def abort(self, request_id: str, reason: str = "abort") -> None: ...


# Each sequence's state after one output: index -> (text length, token count, finished).
StepMark = dict[int, tuple[int, int, bool]]


def step_mark(output: RequestOutput) -> StepMark:
    return {c.index: (len(c.text), len(c.token_ids), c.finish_reason is not None) for c in output.outputs}


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative ``RequestOutput``.

    Outputs are cumulative, so a consumer slower than the engine loses nothing by seeing only the
    newest one: each ``__anext__`` returns the latest output not yet returned. The iteration ends
    after the finished output (finish reasons "stop", "length", "abort" or "error"). ``steps``
    then holds where each output since the previous one left every sequence (the last: the one
    returned), so that a streamed response can still send one chunk per engine step; a consumer
    that ignores it holds only the marks of the outputs it skipped."""

    def __init__(self, client: _Aborter, prepared: PreparedRequest,
                 on_wait: Callable[[float], None] | None = None) -> None:
        """``on_wait(seconds)``: how long each output taken waited here (from the first output put
        since the last take), for the client's ``stream_wait`` samples."""
        self.client = client
        self._on_wait = on_wait
        self._waiting_since: float | None = None
        self.request_id = prepared.request_id
        self.prepared = prepared
        self.finished = False  # the finished output has been received
        self._latest: RequestOutput | None = None
        self._last: RequestOutput | None = None
        self._ready = asyncio.Event()
        self._returned_final = False
        self._error: BaseException | None = None
        self._marks: list[StepMark] = []  # of the outputs put since the last take
        self.steps: list[StepMark] = []  # of the outputs up to the one ``__anext__`` returned last

    def _put(self, output: RequestOutput) -> None:
        if self._waiting_since is None and self._on_wait is not None:
            self._waiting_since = time.monotonic()
        self._latest = output
        self._last = output
        self._marks.append(step_mark(output))  # now: the token lists grow with the next output
        self.finished = self.finished or output.finished
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._ready.set()

    def _aborted(self) -> None:
        """The request was aborted here: end the iteration with an output saying so."""
        self._end("abort")

    def _errored(self, error: str) -> None:
        """The engine failed: end the iteration with an output of finish reason "error"."""
        self._end("error", error)

    def _end(self, finish_reason: str, error: str | None = None) -> None:
        """End the iteration with a finished output: the last one's children, the unfinished ones
        marked ``finish_reason``."""
        if self.finished:
            return
        last = self._last
        n = self.prepared.params.n
        previous = {c.index: c for c in last.outputs} if last is not None else {}
        outputs = []
        for index in range(n):
            child = previous.get(index)
            if child is None:
                child = CompletionOutput(index=index, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
            elif child.finish_reason is None:
                child = CompletionOutput(index=index, text=child.text, token_ids=list(child.token_ids),
                                         cumulative_logprob=child.cumulative_logprob, logprobs=child.logprobs)
            if child.finish_reason is None:
                child.finish_reason = finish_reason
            outputs.append(child)
        self._put(RequestOutput(
            request_id=self.request_id,
            prompt=self.prepared.prompt,
            prompt_token_ids=self.prepared.prompt_token_ids,
            prompt_logprobs=last.prompt_logprobs if last is not None else None,
            outputs=outputs,
            finished=True,
            error=error,
        ))

    def abort(self, reason: str = "abort") -> None:
        """Abort the request unless it has finished (no-op then)."""
        if not self.finished:
            self.client.abort(self.request_id, reason)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._returned_final:
                raise StopAsyncIteration
            if self._latest is None and self._error is None:
                self._ready.clear()
                await self._ready.wait()
            if self._error is not None:
                self._returned_final = True
                raise self._error
            output, self._latest = self._latest, None
            if output is None:
                continue
            self.steps, self._marks = self._marks, []
            if self._waiting_since is not None and self._on_wait is not None:
                self._on_wait(time.monotonic() - self._waiting_since)
                self._waiting_since = None
            if output.finished:
                self._returned_final = True
            return output
