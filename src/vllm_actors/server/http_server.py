"""uvicorn as every API process of ``vllm-actors serve`` runs it: draining on the first stop
signal, stopping when the group fails, its log lines under our rate limits."""

from __future__ import annotations

import signal
from collections.abc import Callable
from types import FrameType

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
