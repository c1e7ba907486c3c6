"""An actor's start-up handshake with the metrics store (``zmq_shell.wait_until_seen``): it returns only once
the store has seen the handshake sent on *this* publisher, and the copies it resends keep one sequence
number (CI at 559e957: the store had seen the start-up publisher's STARTING, the check passed at once, the
new socket's first events were lost to the slow joiner and the actor looked STARTING for ever)."""

from __future__ import annotations

import threading
from pathlib import Path

import msgspec
import zmq

from vllm_actors.protocol.events import ActorStarting, EventBatch, Heartbeat
from vllm_actors.protocol.metrics import ActorSeen, MetricsCodec, SeenReply
from vllm_actors.runtime.zmq_shell import EventPublisher, wait_until_seen

ACTOR = "kv_cache_manager"
DROPPED = 3  # the fake store ignores the first copies, as a subscription on its way would


class FakeStore(threading.Thread):
    """Answers SeenQuery as a store that saw the actor's STARTING (seq 0) from an earlier socket; the
    batches arriving on its bus endpoint count from the ``DROPPED + 1``-th on."""

    def __init__(self, context: zmq.Context, bus: str, metrics: str) -> None:
        super().__init__(daemon=True)
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(bus)
        self.router = context.socket(zmq.ROUTER)
        self.router.bind(metrics)
        self.received: list[int] = []  # first_seq of every batch that reached the bus endpoint
        self.stop = threading.Event()

    def run(self) -> None:
        codec, decoder = MetricsCodec(), msgspec.msgpack.Decoder(EventBatch)
        poller = zmq.Poller()
        poller.register(self.sub, zmq.POLLIN)
        poller.register(self.router, zmq.POLLIN)
        while not self.stop.is_set():
            ready = dict(poller.poll(20))
            if self.sub in ready:
                _, frame = self.sub.recv_multipart()
                self.received.append(decoder.decode(frame).first_seq)
            if self.router in ready:
                identity, _ = self.router.recv_multipart()
                applied = self.received[DROPPED:]
                seen = ActorSeen(last_seq=max(applied, default=0), num_events=1 + len(applied))
                self.router.send_multipart([identity, codec.encode(SeenReply(actors={ACTOR: seen}))])
        self.sub.close()
        self.router.close()


def test_the_handshake_is_resent_with_one_sequence_until_the_store_saw_it(tmp_path: Path) -> None:
    context = zmq.Context()
    store = FakeStore(context, f"ipc://{tmp_path}/bus", f"ipc://{tmp_path}/metrics")
    store.start()
    publisher = EventPublisher(context, f"ipc://{tmp_path}/bus", ACTOR)
    try:
        publisher.stamper.next_seq = 1  # the start-up publisher sent STARTING as 0
        wait_until_seen(publisher, context, f"ipc://{tmp_path}/metrics", ACTOR, 60.0, lambda: Heartbeat(pid=1))
        assert len(store.received) > DROPPED  # it waited for the store to see its own socket's handshake
        assert set(store.received) == {1}  # every copy the same batch: nothing for the store to count lost
        assert publisher.publish([ActorStarting(pid=1, role="kv")]) is not None
        assert publisher.stamper.next_seq == 3  # the handshake took one number, whatever the copies
    finally:
        store.stop.set()
        store.join()
        publisher.close()
        context.term()
