"""uvicorn as every API process of ``vllm-actors serve`` runs it: draining on the first stop
signal, stopping when the group fails, its log lines under our rate limits."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import structlog
import uvicorn

from vllm_actors.envs import envs
from vllm_actors.runtime.log_setup import log_rate
from vllm_actors.runtime.stdlib_log_limits import install as install_log_limits
from vllm_actors.server.serving import ServerState

log = structlog.get_logger(__name__)


def limit_uvicorn_logs() -> None:
    """uvicorn logs through the standard library: the same bounds as our own lines (an access line
    per request is allowed ten times the rate of any other line)."""
    rate = log_rate()
    debug = envs.VLLM_ACTORS_LOG_LEVEL == "DEBUG"
    install_log_limits(["uvicorn.error"], rate, debug=debug)
    install_log_limits(["uvicorn.access"], 10 * rate, debug=debug)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, marking the app as draining the moment a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.drain_listeners: list[Callable[[], None]] = []  # called once, when draining starts

    def on_group_failed(self, reason: str) -> None:
        """The group gave up (its open requests have ended with an error): stop serving."""
        log.error("the process group failed: stopping the server", reason=reason)
        self.should_exit = True

    def drain(self) -> None:
        """Stop taking requests and let the running ones finish (the first stop signal's effect)."""
        if not self.state.draining:
            self.handle_exit(signal.SIGTERM, None)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.state.draining:
            log.info("draining", signal=signal.Signals(sig).name)
            self.state.draining = True
            for listener in self.drain_listeners:
                listener()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, idle keep-alive connections dropped first: closed gracefully, a TLS
        connection waits for the client's close_notify, up to asyncio's 30 s, and the stop with it."""
        drop_idle_connections(self.server_state.connections)
        await super().shutdown(sockets)


def drop_idle_connections(connections: Iterable[Any]) -> int:
    """Abort the HTTP connections between requests (no response in progress); a request being
    answered finishes, and a WebSocket (no request cycle) closes as uvicorn closes it. Returns how many."""
    dropped = 0
    for connection in list(connections):
        if not hasattr(connection, "cycle"):
            continue
        cycle = connection.cycle
        if cycle is None or cycle.response_complete:
            connection.transport.abort()
            dropped += 1
    return dropped
