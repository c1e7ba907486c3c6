"""The client's channel to the metrics store: a query cancelled before its reply came (a caller's
own timeout, a cancelled task) must not leave that reply to answer the next query."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from vllm_actors.clients.async_health import MetricsChannel
from vllm_actors.protocol.metrics import MetricsCodec, SummaryQuery, SummaryReply


class SlowStore:
    """A ROUTER answering its k-th query with ``SummaryReply(num_events=k)``; the first reply waits
    for ``release``."""

    def __init__(self, address: str) -> None:
        self.received_first = threading.Event()
        self.release = threading.Event()
        self.sent_first = threading.Event()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        codec, count = MetricsCodec(), 0
        while not self._stop.is_set():
            if not self._socket.poll(20):
                continue
            identity, frame = self._socket.recv_multipart()
            codec.decode_query(frame)
            count += 1
            if count == 1:
                self.received_first.set()
                while not self.release.wait(0.02):
                    if self._stop.is_set():
                        return
            self._socket.send_multipart([identity, codec.encode(SummaryReply(num_events=count))])
            if count == 1:
                self.sent_first.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()


@pytest.mark.asyncio
async def test_a_cancelled_query_leaves_no_reply_for_the_next_one(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/metrics"
    store = SlowStore(address)
    context = zmq.asyncio.Context()
    channel = MetricsChannel(context, address)
    try:
        first = asyncio.create_task(channel.query(SummaryQuery()))
        assert await asyncio.to_thread(store.received_first.wait, 30)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        store.release.set()  # the first reply goes out now, after its asker gave up
        assert await asyncio.to_thread(store.sent_first.wait, 30)
        reply = await channel.query(SummaryQuery(), timeout=30)
        assert isinstance(reply, SummaryReply) and reply.num_events == 2  # its own reply, not the first's
    finally:
        channel.close()
        context.term()
        store.close()
