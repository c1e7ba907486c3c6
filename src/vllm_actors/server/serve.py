"""``vllm-actors serve``: the OpenAI-compatible server's process.

This process is the supervisor: it starts the process group (bus, metrics store, worker,
KV-cache manager, scheduler), and once every actor is READY it serves HTTP with uvicorn on the
same event loop as its AsyncEngineClient (tokenising and detokenising happen here, so text never
crosses a socket). On SIGTERM or SIGINT it stops taking requests (the listening socket closes,
idle connections close, anything that still arrives gets 503 and /health turns 503), lets
running requests finish for up to ``--shutdown-timeout`` seconds, aborts what is left (reason
"shutdown"), then stops every actor. A second SIGINT forces the exit at once.

The group's supervisor restarts an actor that dies or hangs while serving goes on (``/health``
says what is down meanwhile). When it gives up (``--max-restarts`` within ``--restart-window``
spent, or an actor that cannot start again), every open request ends with an error, new ones get
503, the server stops and the command exits with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
from pathlib import Path
from types import FrameType
from typing import Any

import structlog
import uvicorn

from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.core import load_group_tokenizer
from vllm_actors.runtime.gc_tuning import freeze_startup_heap
from vllm_actors.server.api_pool import KILL_GRACE_SECONDS, ApiServerPool
from vllm_actors.server.app import cache_config_labels, server_state
from vllm_actors.server.app_settings import AppSettings
from vllm_actors.server.args import supervision_kwargs
from vllm_actors.server.auth import api_keys_from
from vllm_actors.server.http_args import check_ssl
from vllm_actors.server.http_server import DrainingServer, limit_uvicorn_logs
from vllm_actors.server.metrics import share_histograms
from vllm_actors.server.targets import parse_default_targets

log = structlog.get_logger(__name__)


class _Stop:
    """Signals before uvicorn takes them over (and after it gives them back)."""

    def __init__(self) -> None:
        self.requested = False
        self.raise_on_signal = True

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if self.raise_on_signal:
            raise SystemExit(128 + signum)


def run_serve(args: argparse.Namespace, engine_args: dict[str, Any]) -> int:
    from vllm_actors.engine_args import make_engine_config
    from vllm_actors.runtime.supervisor import ProcessGroup

    model = args.model_tag or args.model
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models named: {args.model_tag!r} and --model {args.model!r}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:  # vLLM's check, before anything starts
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
    config = make_engine_config(model, engine_args)
    parse_default_targets(args.default_targets)  # a malformed --default-targets fails before the group starts
    for flag in ("default_ttft_target_ms", "default_e2e_target_ms"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be a positive number of milliseconds, got {value}")
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    api_keys = api_keys_from(args.api_key)  # an empty key fails here, before the group starts
    check_ssl(args.ssl_keyfile, args.ssl_certfile, args.ssl_cert_reqs)
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    group = ProcessGroup(config, check_invariants=config.check_invariants, **supervision_kwargs(args))
    try:
        group.start()  # a signal now raises SystemExit: start() stops what it started
        stop.raise_on_signal = False  # from here on a signal means: drain, then stop
        failure = asyncio.run(_serve(group, args, stop, api_keys))
    finally:
        group.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if failure is not None:
        log.error("server stopped: the process group failed", reason=failure)
        return 1
    log.info("server stopped")
    return 0


async def _serve(group: Any, args: argparse.Namespace, stop: _Stop, api_keys: list[str]) -> str | None:
    """Serve until stopped; returns why the group failed, if it did."""
    tokenizer = await asyncio.to_thread(load_group_tokenizer, group.info)
    client = AsyncEngineClient(group.info, tokenizer, group=group, load_tokenizer=False)
    pool: ApiServerPool | None = None
    listener: socket.socket | None = None
    try:
        await client.connect()
        count = args.api_server_count
        settings = AppSettings.from_args(args, group.config.max_num_seqs * group.config.data_parallel_size,
                                         api_keys, processes=count)  # every replica's, shared out
        settings.cache_config = cache_config_labels(client)
        metrics_dir = str(Path(group.run_dir) / "prometheus")
        if count > 1:
            share_histograms(metrics_dir)
        app = settings.build(client)
        state = server_state(app)
        config = uvicorn.Config(app, host=args.host, port=args.port, **settings.uvicorn_kwargs())
        listener = config.bind_socket()
        limit_uvicorn_logs()
        server = DrainingServer(config, state)
        client.add_failure_listener(server.on_group_failed)
        if count > 1:
            pool = ApiServerPool(settings, group.info.run_dir, listener, count, metrics_dir)
            server.drain_listeners.append(pool.drain)
            await asyncio.to_thread(pool.start)
        if stop.requested or client.failed is not None:
            return client.failed
        log.info("serving", host=args.host, port=args.port, model=client.model, run_dir=group.info.run_dir,
                 api_key=bool(api_keys), api_servers=count, tls=bool(settings.ssl))
        freeze_startup_heap()
        await server.serve(sockets=[listener])
        if state.client.num_unfinished:
            log.warning("aborting requests still running after the grace period", count=state.client.num_unfinished)
        return client.failed
    finally:
        if pool is not None:
            await asyncio.to_thread(pool.stop, args.shutdown_timeout + KILL_GRACE_SECONDS)
        if listener is not None:
            listener.close()
        await client.shutdown(reason="shutdown")
