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
import os
import signal
from types import FrameType
from typing import Any

import structlog
import uvicorn

from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.core import load_group_tokenizer
from vllm_actors.runtime.log_setup import log_rate
from vllm_actors.runtime.stdlib_log_limits import install as install_log_limits
from vllm_actors.server.app import build_app, server_state
from vllm_actors.server.args import supervision_kwargs
from vllm_actors.server.auth import api_keys_from
from vllm_actors.server.limits import RequestLimits
from vllm_actors.server.serving import ServerOptions, ServerState
from vllm_actors.server.targets import Targets, parse_default_targets

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
    from vllm_actors.llm import make_engine_config
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
    api_keys = api_keys_from(args.api_key)  # an empty key fails here, before the group starts
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    check = os.environ.get("VLLM_ACTORS_CHECK_INVARIANTS", "") not in ("", "0")
    group = ProcessGroup(config, check_invariants=check, **supervision_kwargs(args))
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
    try:
        await client.connect()
        app = build_app(
            client,
            served_model_names=args.served_model_name,
            max_num_seqs=group.config.max_num_seqs * group.config.data_parallel_size,  # every replica's
            max_waiting_requests=args.max_waiting_requests if args.max_waiting_requests >= 0 else None,
            api_key=api_keys,
            limits=RequestLimits.for_model(client.max_model_len, max_prompt_bytes=args.max_prompt_bytes,
                                           max_body_bytes=args.max_request_body_bytes),
            options=ServerOptions(max_logprobs=args.max_logprobs,
                                  return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                                  trust_request_chat_template=args.trust_request_chat_template,
                                  prompt_tokens_details=args.enable_prompt_tokens_details,
                                  enable_auto_tool_choice=args.enable_auto_tool_choice,
                                  tool_call_parser=args.tool_call_parser,
                                  default_targets=Targets(args.default_ttft_target_ms, args.default_e2e_target_ms),
                                  endpoint_targets=parse_default_targets(args.default_targets)),
        )
        state = server_state(app)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            timeout_graceful_shutdown=args.shutdown_timeout,
            log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
            lifespan="off",
        )
        # uvicorn logs through the standard library: the same bounds as our own lines (an access
        # line per request is allowed ten times the rate of any other line).
        rate = log_rate()
        debug = os.environ.get("VLLM_ACTORS_LOG_LEVEL", "").upper() == "DEBUG"
        install_log_limits(["uvicorn.error"], rate, debug=debug)
        install_log_limits(["uvicorn.access"], 10 * rate, debug=debug)
        server = _DrainingServer(config, state)
        client.add_failure_listener(server.on_group_failed)
        if stop.requested or client.failed is not None:
            return client.failed
        log.info("serving", host=args.host, port=args.port, model=client.model, run_dir=group.info.run_dir,
                 api_key=bool(api_keys))
        await server.serve()
        if state.client.num_unfinished:
            log.warning("aborting requests still running after the grace period", count=state.client.num_unfinished)
        return client.failed
    finally:
        await client.shutdown(reason="shutdown")


class _DrainingServer(uvicorn.Server):
    """uvicorn's Server, marking the app as draining the moment a stop signal arrives."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def on_group_failed(self, reason: str) -> None:
        """The group gave up (its open requests have ended with an error): stop serving."""
        log.error("the process group failed: stopping the server", reason=reason)
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.state.draining:
            log.info("draining", signal=signal.Signals(sig).name)
        self.state.draining = True
        super().handle_exit(sig, frame)
