"""A stopping server drops idle keep-alive connections at once (a graceful TLS close would wait up to
asyncio's 30 s for a client that never answers), and lets a response in progress finish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_actors.server.http_server import drop_idle_connections


@dataclass
class Transport:
    aborted: bool = False

    def abort(self) -> None:
        self.aborted = True


@dataclass
class Cycle:
    response_complete: bool


@dataclass
class HttpConnection:
    cycle: Cycle | None
    transport: Transport = field(default_factory=Transport)


@dataclass
class WebSocketConnection:  # uvicorn's WebSocket protocols have no request cycle
    transport: Transport = field(default_factory=Transport)


def test_idle_http_connections_are_dropped_and_busy_ones_kept() -> None:
    never_used, between, answering = HttpConnection(None), HttpConnection(Cycle(True)), HttpConnection(Cycle(False))
    socket_ = WebSocketConnection()
    connections: list[Any] = [never_used, between, answering, socket_]
    assert drop_idle_connections(connections) == 2
    assert never_used.transport.aborted and between.transport.aborted
    assert not answering.transport.aborted and not socket_.transport.aborted
