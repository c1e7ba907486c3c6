"""The serve command's own flags (the engine's come from ``cli.add_engine_arguments``). Imports
nothing heavy: the CLI builds its parser from this on every invocation."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_actors.server.http_args import add_http_arguments

DEFAULT_MAX_WAITING_REQUESTS = 1024
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
TOOL_CALL_PARSERS = ("hermes",)  # --tool-call-parser: the Hermes/Qwen <tool_call>{...}</tool_call> format
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # --reasoning-parser: <think>...</think> (server/reasoning.py)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-server-count", "-asc", type=int, default=1,
                        help="API processes serving HTTP on the one port (vLLM's flag): each tokenises, "
                             "detokenises and streams for its share of the connections (default 1)")
    parser.add_argument("--lora-modules", nargs="+", default=None,
                        help="LoRA adapters served as model names (with --enable-lora): name=path, or vLLM's JSON "
                             "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="model name(s) clients use; the first is reported (default: the model path)")
    parser.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                        help="requests in flight beyond --max-num-seqs before new ones get 503 with Retry-After "
                             "(negative: no bound)")
    parser.add_argument("--max-prompt-bytes", type=int, default=None,
                        help="longest prompt text (UTF-8 bytes; a chat: its rendered text) tokenised; longer ones "
                             "get 400 before tokenising (default: max_model_len x 32)")
    parser.add_argument("--max-request-body-bytes", type=int, default=None,
                        help="largest request body; larger ones get 413 (default: 6 x --max-prompt-bytes, "
                             "within 1 MiB .. 32 MiB)")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT,
                        help="seconds running requests may take to finish after SIGTERM/SIGINT")
    parser.add_argument("--api-key", nargs="+", default=None,
                        help="require 'Authorization: Bearer <key>' on every endpoint but /health (401 without); "
                             "several keys may be given (default: $VLLM_API_KEY, else no authentication)")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most logprobs per position a request may ask for (logprobs, top_logprobs, "
                             "prompt_logprobs); -1: the whole vocabulary (vLLM's flag; default 20)")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="spell tokens in logprobs as 'token_id:<id>' (a request's return_tokens_as_token_ids "
                             "overrides it)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report usage.prompt_tokens_details.cached_tokens: prompt tokens served from the "
                             "prefix cache (vLLM's flag)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let requests bring their own chat_template (refused with 400 otherwise)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let requests use tool_choice \"auto\" (needs --tool-call-parser; vLLM's flag)")
    parser.add_argument("--tool-call-parser", default=None, choices=list(TOOL_CALL_PARSERS),
                        help="how tool calls are read out of the model's text for tool_choice \"auto\": hermes "
                             "(<tool_call>{...}</tool_call>, Hermes and Qwen models)")
    parser.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                        help="return the model's <think>...</think> text in the chat message's reasoning field "
                             "(streamed as reasoning deltas), structured outputs and tool calls after it: qwen3 or "
                             "deepseek_r1 (vLLM's names; the tags must be tokens of the model)")
    parser.add_argument("--default-ttft-target-ms", type=float, default=None,
                        help="time-to-first-token target of requests that set no ttft_target_ms (edf, lrs, "
                             "--reject-unmeetable)")
    parser.add_argument("--default-e2e-target-ms", type=float, default=None,
                        help="end-to-end target of requests that set no e2e_target_ms")
    parser.add_argument("--default-targets", action="append", default=[], metavar="ENDPOINT:ttft=MS,e2e=MS",
                        help="per-endpoint defaults (completions, chat), e.g. chat:ttft=200,e2e=5000; before "
                             "--default-*-target-ms")
    add_http_arguments(parser)
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    add_supervision_arguments(parser)


# The supervisor's knobs: unset flags leave the supervisor's own defaults.
_SUPERVISION_FLAGS = ("max_restarts", "restart_window", "liveness_timeout", "max_busy_seconds")


def add_supervision_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("supervision", "restarting actors that die or hang")
    group.add_argument("--max-restarts", type=int, default=None,
                       help="restarts allowed within --restart-window before the group fails and the server "
                            "exits non-zero (default: 5)")
    group.add_argument("--restart-window", type=float, default=None, help="seconds (default: 60)")
    group.add_argument("--liveness-timeout", type=float, default=None,
                       help="seconds without a liveness ping before an actor counts as hung (default: 5)")
    group.add_argument("--max-busy-seconds", type=float, default=None,
                       help="seconds one message may take before the actor counts as hung (default: 300)")


def supervision_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The supervision flags given, as ProcessGroup keyword arguments."""
    kwargs: dict[str, Any] = {}
    for name in _SUPERVISION_FLAGS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if value < 0 or (value == 0 and name != "max_restarts"):
            bound = ">= 0" if name == "max_restarts" else "> 0"
            raise ValueError(f"--{name.replace('_', '-')} must be {bound}, got {value}")
        kwargs[name] = value
    return kwargs
