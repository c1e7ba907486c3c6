"""A client of a running process group: the frontend's state machine on ZMQ sockets.

It tokenises, validates and detokenises in the calling process (the frontend actor's work), sends
requests and aborts to the scheduler over a DEALER socket, receives the updates of its own
requests, and publishes its own events (ARRIVED, stop-string FINISHED) on the bus. The offline
``LLM`` and the HTTP server both use it.
"""

from __future__ import annotations

import itertools
import os
import secrets
import weakref
from typing import Any

import msgspec
import structlog
import zmq

from vllm_actors.actors.frontend.frontend import Frontend, PreparedRequest, PromptInput
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.messages import RequestUpdates
from vllm_actors.protocol.metrics import MetricsCodec, MetricsQuery, MetricsReply
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runtime.run_dir import GroupInfo
from vllm_actors.runtime.transport import route_frontend_outputs
from vllm_actors.runtime.zmq_shell import EventPublisher

log = structlog.get_logger(__name__)

_counter = itertools.count()


def _close_sockets(sockets: list[zmq.Socket], context: zmq.Context) -> None:
    for socket in sockets:
        socket.close(linger=0)
    context.term()


def frontend_for_group(info: GroupInfo, tokenizer: Any) -> Frontend:
    """The frontend state machine for a running group: model facts come from what its worker
    reported at start-up."""
    facts = info.worker
    return Frontend(
        tokenizer,
        list(facts.get("eos_token_ids", [])),  # type: ignore[arg-type]
        info.max_model_len,
        int(facts.get("vocab_size", 0)),  # type: ignore[arg-type]
    )


class EngineClient:
    def __init__(self, info: GroupInfo, tokenizer: Any = None) -> None:
        self.info = info
        self.frontend = frontend_for_group(info, tokenizer)
        self.identity = f"client-{os.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"
        self._context = zmq.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(info.addresses.scheduler)
        self._publisher = EventPublisher(self._context, info.addresses.bus_in, self.identity.replace("client", "frontend"))
        self._metrics = self._context.socket(zmq.DEALER)
        self._metrics.setsockopt(zmq.LINGER, 0)
        self._metrics.connect(info.addresses.metrics)
        self._codec = MessageCodec()
        self._metrics_codec = MetricsCodec()
        self._finalizer = weakref.finalize(
            self, _close_sockets, [self._dealer, self._publisher.socket, self._metrics], self._context
        )

    # ------------------------------------------------------------------ requests
    def prepare(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> PreparedRequest:
        return self.frontend.prepare(request_id, prompt, params)

    def submit(self, prepared: PreparedRequest) -> None:
        self._send(self.frontend.submit(prepared))

    def abort(self, request_id: str) -> None:
        self._send(self.frontend.abort(request_id))

    @property
    def has_unfinished(self) -> bool:
        return self.frontend.num_unfinished > 0

    def _send(self, outputs: list[tuple[str, Any]]) -> list[Any]:
        client_outputs, onward = route_frontend_outputs(outputs, self._publisher.publish)
        for _, message in onward:  # everything onward goes to the scheduler
            self._dealer.send(self._codec.encode(message))
        return client_outputs

    def poll(self, timeout_ms: int = 100) -> list[RequestOutput]:
        """Wait up to ``timeout_ms`` for updates; return the outputs they produced."""
        outputs: list[RequestOutput] = []
        if not self._dealer.poll(timeout_ms):
            return outputs
        while True:
            try:
                payload = self._dealer.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return outputs
            try:
                message = self._codec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                log.warning("frame dropped", actor=self.identity, why="undecodable", error=str(error))
                continue
            if not isinstance(message, RequestUpdates):
                log.warning("frame dropped", actor=self.identity, why="unexpected type", type=type(message).__name__)
                continue
            outputs.extend(self._send(self.frontend.handle(message)))

    # ------------------------------------------------------------------ metrics
    def query_metrics(self, query: MetricsQuery, timeout_ms: int = 5000) -> MetricsReply:
        self._metrics.send(self._metrics_codec.encode(query))
        if not self._metrics.poll(timeout_ms):
            raise TimeoutError("the metrics store did not answer")
        return self._metrics_codec.decode_reply(self._metrics.recv())

    def close(self) -> None:
        self._finalizer()
