"""A client of a running process group: the frontend's state machine on plain ZMQ sockets.

It tokenises, validates and detokenises in the calling process (the frontend actor's work), sends
requests and aborts to the scheduler over a DEALER socket, receives the updates of its own
requests, and publishes its own events (ARRIVED, stop-string FINISHED) on the bus. The offline
``LLM`` uses it for a process group; the shared paths are ``ClientCore``'s.
"""

from __future__ import annotations

import itertools
import os
import secrets
import weakref
from typing import TYPE_CHECKING

import zmq

from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.core import SyncClient, ZmqTransport, frontend_for_group
from vllm_actors.protocol.metrics import MetricsCodec, MetricsQuery, MetricsReply
from vllm_actors.runtime.run_dir import GroupInfo
from vllm_actors.runtime.zmq_shell import EventPublisher

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer

__all__ = ["EngineClient", "frontend_for_group"]

_counter = itertools.count()


def _close_sockets(sockets: list[zmq.Socket], context: zmq.Context) -> None:
    for socket in sockets:
        socket.close(linger=0)
    context.term()


class EngineClient(SyncClient):
    def __init__(self, info: GroupInfo, tokenizer: Tokenizer | None = None) -> None:
        self.info = info
        self.identity = f"client-{os.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"
        self._context = zmq.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(info.addresses.scheduler)
        publisher = EventPublisher(self._context, info.addresses.bus_in, self.identity.replace("client", "frontend"))
        self._metrics = self._context.socket(zmq.DEALER)
        self._metrics.setsockopt(zmq.LINGER, 0)
        self._metrics.connect(info.addresses.metrics)
        self._metrics_codec = MetricsCodec()
        self._finalizer = weakref.finalize(
            self, _close_sockets, [self._dealer, publisher.socket, self._metrics], self._context
        )
        super().__init__(frontend_for_group(info, tokenizer), ZmqTransport(self._dealer, publisher), self.identity)

    def poll(self, timeout_ms: int = 100) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if not self._dealer.poll(timeout_ms):
            return outputs
        while True:
            try:
                payload = self._dealer.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return outputs
            outputs.extend(self._receive_frame(payload))

    def query_metrics(self, query: MetricsQuery, timeout_ms: int = 5000) -> MetricsReply:
        self._metrics.send(self._metrics_codec.encode(query))
        if not self._metrics.poll(timeout_ms):
            raise TimeoutError("the metrics store did not answer")
        return self._metrics_codec.decode_reply(self._metrics.recv())

    def close(self) -> None:
        self._finalizer()
