"""The supervisor monitor's I/O: the children's stdout lines, and its own sockets.

``LineReader`` splits a child's stdout pipe into lines without ever blocking (one ``os.read`` per
readiness, as ``select``/``selectors`` report it). ``SupervisorLink`` is what the monitor thread
says to the group: its events on the bus (actor id ``SUPERVISOR``), delivered only once the
metrics store is seen to receive them (a handshake after start and after the bus or the store was
restarted: PUB/SUB drops what is sent before the subscriptions are through), and ``RecoverPipeline``
to the scheduler through a DEALER with identity ``SUPERVISOR``. Its sockets belong to the monitor
thread: create, use and close them there only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import IO, Any

import structlog
import zmq

from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import Heartbeat
from vllm_actors.protocol.messages import RecoverPipeline
from vllm_actors.protocol.metrics import MetricsCodec, SeenQuery
from vllm_actors.protocol.names import SUPERVISOR
from vllm_actors.runtime.run_dir import GroupAddresses
from vllm_actors.runtime.security import GroupKeys, connect
from vllm_actors.runtime.zmq_shell import EventPublisher

log = structlog.get_logger(__name__)

READ_CHUNK = 1 << 16


class LineReader:
    """Complete lines from a pipe; ``fill`` reads once (call it when the fd is readable)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.fd = stream.fileno()
        self.eof = False
        self._buffer = b""

    def fill(self) -> None:
        try:
            data = os.read(self.fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.eof = True
        self._buffer += data

    def lines(self) -> list[bytes]:
        """The complete lines read so far (without their newline)."""
        if b"\n" not in self._buffer:
            return []
        *complete, self._buffer = self._buffer.split(b"\n")
        return [line for line in complete if line.strip()]


class SupervisorLink:
    """The monitor thread's sockets: events out (confirmed by the metrics store), pipeline resets."""

    def __init__(self, addresses: GroupAddresses, stop: threading.Event,
                 clock: Callable[[], float] = time.monotonic, *, keys: GroupKeys | None = None) -> None:
        self.addresses = addresses
        self.keys = keys
        self.stop = stop
        self._clock = clock
        self.context = zmq.Context()
        self.publisher = EventPublisher.for_actor(self.context, addresses, SUPERVISOR, keys)
        self.scheduler = self.context.socket(zmq.DEALER)
        self.scheduler.setsockopt(zmq.IDENTITY, SUPERVISOR.encode())
        self.scheduler.setsockopt(zmq.LINGER, 0)
        connect(self.scheduler, addresses.scheduler, keys)
        self._dealers: dict[str, zmq.Socket] = {}  # to the replicas' schedulers (data_parallel_size > 1)
        self._codec = MessageCodec()
        self._metrics_codec = MetricsCodec()
        self.confirmed = False  # the store has received our events since the bus and store last started

    def unconfirm(self) -> None:
        """The bus or the store restarted: confirm the path again before the next event."""
        self.confirmed = False

    def _last_seen(self, dealer: zmq.Socket, wait: float) -> int:
        """The sequence number of our last event the store has applied (-1: none, or no reply)."""
        dealer.send(self._metrics_codec.encode(SeenQuery(actor=SUPERVISOR)))
        if not dealer.poll(int(wait * 1000)):
            return -1
        reply = self._metrics_codec.decode_reply(dealer.recv())
        seen = getattr(reply, "actors", {}).get(SUPERVISOR)
        return -1 if seen is None else int(seen.last_seq)

    def _until_seen(self, seq: int, timeout: float, resend: bool) -> bool:
        """Wait until the store has applied our event ``seq``; with ``resend``, publish heartbeats
        meanwhile (each a later seq to wait for). A fresh DEALER: a store that died would never
        answer a query still queued on an old one."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        connect(dealer, self.addresses.metrics, self.keys)
        deadline = self._clock() + timeout
        try:
            while self._clock() < deadline and not self.stop.is_set():
                if resend:
                    batch = self.publisher.publish([Heartbeat(pid=os.getpid())])
                    assert batch is not None
                    seq = batch.first_seq
                if self._last_seen(dealer, 0.2) >= seq:
                    return True
                self.stop.wait(0.02)
            return False
        finally:
            dealer.close()

    def publish(self, events: list[Any], *, confirm_timeout: float = 10.0, wait_seen: bool = False) -> bool:
        """Publish the supervisor's events, once the store is seen to receive ours (bounded by
        ``confirm_timeout``: past it, publish anyway and log). With ``wait_seen``, also wait
        until the store has applied them. True when the store confirmed."""
        if not events:
            return True
        if not self.confirmed:
            began = self._clock()
            self.confirmed = self._until_seen(-1, confirm_timeout, resend=True)
            log.debug("supervisor event path", confirmed=self.confirmed, seconds=round(self._clock() - began, 3))
            if not self.confirmed:
                log.warning("the metrics store does not confirm the supervisor's events; publishing anyway",
                            events=[type(event).__name__ for event in events])
        batch = self.publisher.publish(events)
        if wait_seen and batch is not None:
            return self._until_seen(batch.first_seq + len(batch.events) - 1, confirm_timeout, resend=False)
        return self.confirmed

    def recover_pipeline(self, actor: str, reason: str, address: str | None = None, kv_rank: int = -1,
                         rendezvous: str = "") -> None:
        """``RecoverPipeline`` to the group's scheduler, or to the one at ``address`` (a replica's,
        or the controller's when a replica's scheduler restarted); ``kv_rank``: a KV-parallel rank
        restarted alone, waiting for its peers at ``rendezvous``."""
        payload = self._codec.encode(RecoverPipeline(actor=actor, reason=reason, kv_rank=kv_rank,
                                                     rendezvous=rendezvous))
        if address is None or address == self.addresses.scheduler:
            self.scheduler.send(payload)
            return
        dealer = self._dealers.get(address)
        if dealer is None:
            dealer = self._dealers[address] = self.context.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, SUPERVISOR.encode())
            dealer.setsockopt(zmq.LINGER, 0)
            connect(dealer, address, self.keys)
        dealer.send(payload)

    def close(self) -> None:
        for dealer in self._dealers.values():
            dealer.close()
        self.scheduler.close()
        self.publisher.close()
        self.context.term()
