"""One more API process of ``vllm-actors serve --api-server-count N`` (vLLM's flag): HTTP,
tokenising, detokenising and streaming for its share of the connections, on the listening socket
the serving parent made, as a client attached to the parent's group (``AsyncEngineClient.attach``).

The contract with the parent (``server/api_pool.py``), as an actor's with its supervisor:
- the spec: one JSON-encoded ``ApiProcessSpec``, the first line on stdin (not the command line,
  where ``ps`` would show the API keys it holds); the listening socket is the inherited descriptor
  ``listen_fd``;
- stdin stays a pipe from the parent: EOF on it (the parent died, even by SIGKILL) drains and exits;
- stdout carries one line, ``ready``, once the server serves; everything else (logs, uvicorn's
  access lines) goes to stderr;
- SIGTERM drains (uvicorn's graceful shutdown, up to ``--shutdown-timeout``), a second one ends it
  at once. The process runs in its own session: a terminal's Ctrl-C reaches the parent, which
  drains the processes itself.
Exit status 0 after a drain, 1 when the group failed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys

import msgspec
import structlog
import uvicorn

from vllm_actors.server.app_settings import AppSettings

log = structlog.get_logger(__name__)


class ApiProcessSpec(msgspec.Struct, kw_only=True):
    index: int  # 1..N-1 (the parent serves as 0)
    run_dir: str  # the group's, to attach to
    listen_fd: int
    metrics_dir: str  # Prometheus's multiprocess directory, shared by every API process
    # Its connection's routing id at the scheduler, the same for every start of this index: a
    # restarted process takes over its dead predecessor's connection and aborts what it left.
    identity: str
    settings: AppSettings


def read_spec(fd: int = 0) -> ApiProcessSpec:
    """The first line of ``fd``, byte by byte: nothing after it is consumed (the parent watch reads
    the rest, until EOF)."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            raise SystemExit("the serving parent closed stdin before sending the spec")
        line += byte
    return msgspec.json.decode(bytes(line), type=ApiProcessSpec)


def main() -> int:
    spec = read_spec()
    from vllm_actors.server.metrics import share_histograms

    share_histograms(spec.metrics_dir)  # before the app makes its histograms
    report_fd = os.dup(1)
    os.dup2(2, 1)  # stdout is the parent's report pipe alone
    from vllm_actors.runtime.log_setup import configure_logging

    configure_logging()
    structlog.contextvars.bind_contextvars(api_server=spec.index)
    return asyncio.run(_serve(spec, report_fd))


async def _serve(spec: ApiProcessSpec, report_fd: int) -> int:
    from vllm_actors.clients.async_client import AsyncEngineClient
    from vllm_actors.runtime.gc_tuning import freeze_startup_heap
    from vllm_actors.runtime.process import on_stdin_closed
    from vllm_actors.server.app import server_state
    from vllm_actors.server.http_server import DrainingServer, limit_uvicorn_logs

    listener = socket.socket(fileno=spec.listen_fd)
    client = await AsyncEngineClient.attach(spec.run_dir, identity=spec.identity)
    try:
        app = spec.settings.build(client)
        server = DrainingServer(uvicorn.Config(app, **spec.settings.uvicorn_kwargs()), server_state(app))
        limit_uvicorn_logs()
        client.add_failure_listener(server.on_group_failed)
        loop = asyncio.get_running_loop()

        def parent_gone() -> None:
            log.warning("the serving parent is gone: draining")
            loop.call_soon_threadsafe(server.drain)

        on_stdin_closed(parent_gone)
        freeze_startup_heap()
        ready = asyncio.create_task(_report_ready(server, report_fd))
        try:
            await server.serve(sockets=[listener])
        finally:
            ready.cancel()
        return 1 if client.failed is not None else 0
    finally:
        await client.shutdown(reason="shutdown")


async def _report_ready(server: uvicorn.Server, report_fd: int) -> None:
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        os.write(report_fd, b"ready\n")
    finally:
        os.close(report_fd)


if __name__ == "__main__":
    sys.exit(main())
