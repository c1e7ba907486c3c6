"""The streams of an asyncio client's unfinished requests, and their latency samples."""

from __future__ import annotations

from collections.abc import Callable

from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.latency import LatencyTracker
from vllm_actors.clients.request_stream import RequestStream


class OpenStreams:
    """Request id -> its ``RequestStream``, from submission until its finished output (or its end
    here: an abort, the engine's failure, the reader's death)."""

    def __init__(self, latency: LatencyTracker) -> None:
        self.latency = latency
        self._streams: dict[str, RequestStream] = {}

    def open(self, stream: RequestStream, now: float) -> None:
        self._streams[stream.request_id] = stream
        params = stream.prepared.params
        self.latency.start(stream.request_id, now, params.n, params.max_tokens)

    def close(self, request_id: str) -> RequestStream | None:
        """Stop following a request (it was aborted here); its stream, if it was open."""
        self.latency.forget(request_id)
        return self._streams.pop(request_id, None)

    def request_ids(self) -> list[str]:
        return list(self._streams)

    @property
    def num_engine_requests(self) -> int:
        """Engine requests (n>1 counts n) not finished yet."""
        return sum(stream.prepared.params.n for stream in self._streams.values())

    def dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        """Each output to its request's stream; a finished one closes it."""
        for output in outputs:
            self.latency.on_output(output, now)
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]

    def end_all(self, end: Callable[[RequestStream], None]) -> None:
        """End every open stream with ``end(stream)`` and forget them all."""
        for stream in list(self._streams.values()):
            end(stream)
        self._streams.clear()
        self.latency.clear()
