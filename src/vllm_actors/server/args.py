"""The serve command's own flags (the engine's come from ``cli.add_engine_arguments``). Imports
nothing heavy: the CLI builds its parser from this on every invocation."""

from __future__ import annotations

import argparse

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_SHUTDOWN_TIMEOUT = 30.0


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; the first is reported (default: the model path)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="requests in flight beyond --max-num-seqs before new ones get 503 with Retry-After "
                             "(negative: no bound)")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                        help="seconds running requests may take to finish after SIGTERM/SIGINT")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
