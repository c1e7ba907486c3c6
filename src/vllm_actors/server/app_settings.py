"""What ``vllm-actors serve`` builds each API process's app from: its flags, resolved once in the
serving parent and handed to every API process (``--api-server-count``) as one msgspec struct, so
that all of them answer alike."""

from __future__ import annotations

import argparse
import math
from typing import Any

import msgspec
from fastapi import FastAPI

from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.lora.check import AdapterCheck
from vllm_actors.server.app import build_app
from vllm_actors.server.http_args import RequestIdHeaders, add_cors, ssl_kwargs
from vllm_actors.server.limits import RequestLimits
from vllm_actors.server.lora_routes import LoRAModule, ServedAdapters, parse_lora_modules
from vllm_actors.server.serving import ServerOptions
from vllm_actors.server.targets import Targets, parse_default_targets


class AppSettings(msgspec.Struct, kw_only=True):
    served_model_names: list[str] | None
    max_num_seqs: int  # this process's share of the group's
    max_waiting_requests: int | None  # this process's share (None: no bound)
    api_keys: list[str]
    max_prompt_bytes: int | None
    max_body_bytes: int | None
    max_logprobs: int
    return_tokens_as_token_ids: bool
    trust_request_chat_template: bool
    prompt_tokens_details: bool
    enable_auto_tool_choice: bool
    tool_call_parser: str | None
    reasoning_parser: str | None
    default_ttft_target_ms: float | None
    default_e2e_target_ms: float | None
    default_targets: list[str]
    cache_config: dict[str, str] | None = None  # vllm:cache_config_info's labels, the parent's for all
    # uvicorn
    shutdown_timeout: float
    ssl: dict[str, Any] = {}  # TLS: uvicorn.Config's ssl_* arguments (http_args.ssl_kwargs)
    cors: dict[str, Any] = {}  # http_args.add_cors's arguments (none: no CORS middleware)
    request_id_headers: bool = False  # --enable-request-id-headers
    # LoRA (the engine's --enable-lora, --max-lora-rank) and the adapters served from the start
    enable_lora: bool = False
    max_lora_rank: int = 16
    lora_modules: list[LoRAModule] = []
    uvicorn_log_level: str
    access_log: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace, max_num_seqs: int, api_keys: list[str],
                  processes: int = 1) -> AppSettings:
        """``max_num_seqs`` (every replica's) and ``--max-waiting-requests`` are shared out over
        the ``processes`` API processes: each admits its share (rounded up) of the group's room."""
        waiting = args.max_waiting_requests if args.max_waiting_requests >= 0 else None
        return cls(
            served_model_names=args.served_model_name,
            max_num_seqs=math.ceil(max_num_seqs / processes),
            max_waiting_requests=None if waiting is None else math.ceil(waiting / processes),
            api_keys=api_keys,
            max_prompt_bytes=args.max_prompt_bytes,
            max_body_bytes=args.max_request_body_bytes,
            max_logprobs=args.max_logprobs,
            return_tokens_as_token_ids=args.return_tokens_as_token_ids,
            trust_request_chat_template=args.trust_request_chat_template,
            prompt_tokens_details=args.enable_prompt_tokens_details,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            default_ttft_target_ms=args.default_ttft_target_ms,
            default_e2e_target_ms=args.default_e2e_target_ms,
            default_targets=list(args.default_targets),
            shutdown_timeout=args.shutdown_timeout,
            ssl=ssl_kwargs(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs),
            cors={"origins": args.allowed_origins, "methods": args.allowed_methods,
                  "headers": args.allowed_headers, "credentials": args.allow_credentials},
            request_id_headers=args.enable_request_id_headers,
            enable_lora=bool(getattr(args, "enable_lora", False)),
            max_lora_rank=getattr(args, "max_lora_rank", 16),
            lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)),
            uvicorn_log_level=args.uvicorn_log_level,
            access_log=not args.disable_uvicorn_access_log,
        )

    def build(self, client: AsyncEngineClient) -> FastAPI:
        app = self._build(client)
        if self.request_id_headers:
            app.add_middleware(RequestIdHeaders)  # outside the API key: a 401 carries it too, as vLLM's
        if self.cors:
            add_cors(app, **self.cors)
        return app

    def _build(self, client: AsyncEngineClient) -> FastAPI:
        return build_app(
            client,
            served_model_names=self.served_model_names,
            max_num_seqs=self.max_num_seqs,
            max_waiting_requests=self.max_waiting_requests,
            api_key=self.api_keys,
            limits=RequestLimits.for_model(client.max_model_len, max_prompt_bytes=self.max_prompt_bytes,
                                           max_body_bytes=self.max_body_bytes),
            options=ServerOptions(max_logprobs=self.max_logprobs,
                                  return_tokens_as_token_ids=self.return_tokens_as_token_ids,
                                  trust_request_chat_template=self.trust_request_chat_template,
                                  prompt_tokens_details=self.prompt_tokens_details,
                                  enable_auto_tool_choice=self.enable_auto_tool_choice,
                                  tool_call_parser=self.tool_call_parser,
                                  reasoning_parser=self.reasoning_parser,
                                  default_targets=Targets(self.default_ttft_target_ms, self.default_e2e_target_ms),
                                  endpoint_targets=parse_default_targets(self.default_targets)),
            cache_config=self.cache_config,
            adapters=ServedAdapters(AdapterCheck(self.enable_lora, self.max_lora_rank, client.model),
                                    self.lora_modules),
        )

    def uvicorn_kwargs(self) -> dict[str, Any]:
        return {"timeout_graceful_shutdown": self.shutdown_timeout, "log_level": self.uvicorn_log_level,
                "access_log": self.access_log, "lifespan": "off", **self.ssl}
