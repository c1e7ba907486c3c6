"""A client of a running process group: the frontend's state machine on plain ZMQ sockets.

It tokenises, validates and detokenises in the calling process (the frontend actor's work), sends
requests and aborts to the scheduler over a DEALER socket, receives the updates of its own
requests, and publishes its own events (ARRIVED, stop-string FINISHED) on the bus. The offline
``LLM`` uses it for a process group; the shared paths are ``ClientCore``'s.

Given the group (``group=``, listened to, not owned), it follows the supervisor: after a scheduler
restart ``poll`` sends the unfinished requests again (resume=True, with the tokens received so
far); once the group has failed ``poll`` ends every open request with finish reason "error" and
``submit`` raises ``EngineDeadError``. The supervisor's listeners run on its thread and only set
flags; ``poll`` acts on them in the caller's thread (the sockets and the frontend are not shared).
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
import weakref
from typing import TYPE_CHECKING

import zmq

from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.clients.core import EngineDeadError, SyncClient, ZmqTransport, drop_work_events, frontend_for_group
from vllm_actors.clients.supervision import group_failure, listen
from vllm_actors.protocol.metrics import MetricsCodec, MetricsQuery, MetricsReply
from vllm_actors.protocol.names import ENTRY_ACTORS
from vllm_actors.runtime.run_dir import GroupInfo
from vllm_actors.runtime.security import connect, keys_for
from vllm_actors.runtime.zmq_shell import EventPublisher

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.frontend import PreparedRequest
    from vllm_actors.actors.frontend.tokenizer import Tokenizer

__all__ = ["EngineClient", "EngineDeadError", "frontend_for_group"]

_counter = itertools.count()


def _close_sockets(sockets: list[zmq.Socket], context: zmq.Context) -> None:
    for socket in sockets:
        socket.close(linger=0)
    context.term()


class EngineClient(SyncClient):
    def __init__(self, info: GroupInfo, tokenizer: Tokenizer | None = None, *, group: object | None = None) -> None:
        """``group``: the ``ProcessGroup`` of ``info`` when this process runs it, to follow its
        supervisor (restarts, failure); it is not shut down with the client."""
        self.info = info
        self.group = group
        self.identity = f"client-{os.getpid()}-{next(_counter)}-{secrets.token_hex(3)}"
        keys = keys_for(info.addresses, info.run_dir)  # TCP: the group's CURVE keys
        self._context = zmq.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._dealer.setsockopt(zmq.LINGER, 0)
        connect(self._dealer, info.addresses.scheduler, keys)
        publisher = EventPublisher(self._context, info.addresses.bus_in, self.identity.replace("client", "frontend"),
                                   keys=keys, drop_work_events=drop_work_events(info))
        self._metrics = self._context.socket(zmq.DEALER)
        self._metrics.setsockopt(zmq.LINGER, 0)
        connect(self._metrics, info.addresses.metrics, keys)
        self._metrics_codec = MetricsCodec()
        self._finalizer = weakref.finalize(
            self, _close_sockets, [self._dealer, publisher.socket, self._metrics], self._context
        )
        super().__init__(frontend_for_group(info, tokenizer), ZmqTransport(self._dealer, publisher), self.identity)
        self._scheduler_restarted = threading.Event()
        self._failed_reason: str | None = None  # set by the supervisor's thread, read by poll
        if group is not None:
            listen(group, self._on_restart, self._on_failure)

    # Called on the supervisor's monitor thread: hand over, nothing else.
    def _on_restart(self, actor: str) -> None:
        if actor in ENTRY_ACTORS:  # a replica's scheduler: the controller re-sends its requests
            self._scheduler_restarted.set()

    def _on_failure(self, reason: str) -> None:
        self._failed_reason = reason

    def _group_failure(self) -> str | None:
        return self._failed_reason or (group_failure(self.group) if self.group is not None else None)

    def submit(self, prepared: PreparedRequest) -> None:
        reason = self.failure or self._group_failure()
        if reason is not None:  # the open requests' error outputs are poll's to return
            raise EngineDeadError(f"the engine failed: {reason}")
        super().submit(prepared)

    def poll(self, timeout_ms: int = 100) -> list[RequestOutput]:
        """Wait up to ``timeout_ms`` for updates and return their outputs, acting first on what the
        supervisor reported: once the group failed, the final error outputs of every open request;
        after a scheduler restart, the unfinished requests are sent again (after taking in what
        the old scheduler sent before it died, so that no token is counted twice)."""
        reason = self._group_failure()
        if reason is not None:
            return self._with_held(self.fail_open(reason))
        outputs = self._with_held([])
        if self._scheduler_restarted.is_set():
            self._scheduler_restarted.clear()
            outputs.extend(self._drain())
            self.resubmit_open()
        if self._dealer.poll(timeout_ms):
            outputs.extend(self._drain())
        return outputs

    def _drain(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
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
