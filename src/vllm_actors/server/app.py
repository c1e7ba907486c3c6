"""``build_app(client)``: the OpenAI-compatible ASGI application (FastAPI) over an AsyncEngineClient.

The app holds no lifespan of its own (a mounted sub-application's lifespan never runs): the
client's background tasks start with its first request, and whoever created the client shuts it
down. Mount it under another application as is::

    host.mount("/llm", build_app(client))       # then POST /llm/v1/chat/completions
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
from fastapi import FastAPI, Request
from starlette.responses import Response

from vllm_actors import __version__
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.clients.supervision import Health
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.metrics import SummaryReply
from vllm_actors.server.anthropic_messages import register_anthropic_routes
from vllm_actors.server.args import DEFAULT_MAX_WAITING_REQUESTS
from vllm_actors.server.auth import ApiKeyMiddleware
from vllm_actors.server.chat import create_chat_completion
from vllm_actors.server.completions import create_completion
from vllm_actors.server.errors import error_body, install_error_handlers
from vllm_actors.server.extra_routes import add_extra_routes
from vllm_actors.server.limits import RequestLimits
from vllm_actors.server.lora_routes import ServedAdapters, add_lora_routes, lora_check
from vllm_actors.server.memory import TrimAfterLargeBodies
from vllm_actors.server.metrics import CONTENT_TYPE, ServerMetrics
from vllm_actors.server.protocol import ModelCard, ModelList, encode, now
from vllm_actors.server.reasoning import ReasoningParser
from vllm_actors.server.responses import add_responses_routes
from vllm_actors.server.serving import DEFAULT_MAX_NUM_SEQS, ServerOptions, ServerState

log = structlog.get_logger(__name__)

def cache_config_labels(client: AsyncEngineClient) -> dict[str, str]:
    """``vllm:cache_config_info``'s labels (vLLM: its CacheConfig's fields, each as ``str(value)``),
    from what the group's worker reported and, for a group this client started, its engine config."""
    info = getattr(client, "info", None)
    worker = dict(getattr(info, "worker", {}) or {})
    labels = {"num_gpu_blocks": str(worker.get("num_blocks")), "cache_dtype": "auto",
              "num_cpu_blocks": str(worker.get("num_host_blocks") or None)}  # the host KV tier's
    config = getattr(getattr(client, "group", None), "config", None)
    if isinstance(config, EngineConfig):
        labels.update(block_size=str(config.block_size), enable_prefix_caching=str(config.enable_prefix_caching),
                      gpu_memory_utilization=str(config.gpu_memory_utilization),
                      num_gpu_blocks_override=str(config.num_gpu_blocks_override), cache_dtype=config.kv_cache_dtype)
    return labels


def reasoning_parser(client: AsyncEngineClient, name: str | None) -> ReasoningParser | None:
    """--reasoning-parser over the model's tokenizer (a ValueError where it lacks the tags)."""
    if name is None:
        return None
    tokenizer = client.frontend.tokenizer
    if tokenizer is None:
        raise ValueError(f"--reasoning-parser {name}: needs the model's tokenizer (skip_tokenizer_init is set)")
    return ReasoningParser.create(name, tokenizer.token_to_id)


def build_app(
    client: AsyncEngineClient,
    *,
    served_model_names: list[str] | None = None,
    max_num_seqs: int | None = None,
    max_waiting_requests: int | None = DEFAULT_MAX_WAITING_REQUESTS,
    api_key: str | Sequence[str] | None = None,
    limits: RequestLimits | None = None,
    options: ServerOptions | None = None,
    cache_config: dict[str, str] | None = None,
    adapters: ServedAdapters | None = None,
) -> FastAPI:
    """The OpenAI-compatible app. ``served_model_names`` default to the model path; requests
    beyond ``max_num_seqs + max_waiting_requests`` in flight get 503 with Retry-After
    (``max_waiting_requests=None``: no bound). ``api_key`` (one or several): every endpoint but
    ``/health`` then wants ``Authorization: Bearer <key>`` and answers 401 without it. ``limits``:
    the body and prompt sizes taken (default: ``RequestLimits.for_model(max_model_len)``).
    ``options``: vLLM's flags for request fields (--max-logprobs, --return-tokens-as-token-ids,
    --trust-request-chat-template). ``cache_config``: ``vllm:cache_config_info``'s labels (default:
    from the client's group). ``adapters``: the LoRA adapters served by name (default: none, LoRA as
    the client's group has it)."""
    names = list(served_model_names or [client.model])
    adapters = adapters or ServedAdapters(lora_check(client), [])
    metrics = ServerMetrics(names[0], client.max_model_len or 4096, cache_config or cache_config_labels(client))
    client.add_stats_listener(metrics)
    state = ServerState(
        client=client,
        served_model_names=names,
        max_num_seqs=max_num_seqs or client.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        max_waiting_requests=max_waiting_requests,
        metrics=metrics,
        limits=limits or RequestLimits.for_model(client.max_model_len),
        options=options or ServerOptions(),
        reasoning=reasoning_parser(client, options.reasoning_parser if options else None),
        adapters=adapters,
    )
    app = FastAPI(title="vllm_actors OpenAI-compatible server", version=__version__)
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(TrimAfterLargeBodies)
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys)  # outermost: before any body is read

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(request, state)

    add_responses_routes(app, state)
    register_anthropic_routes(app, state)  # /v1/messages, /v1/messages/count_tokens

    @app.get("/v1/models")
    async def models() -> Response:
        cards = [ModelCard(id=name, created=now(), root=client.model, max_model_len=client.max_model_len)
                 for name in names]
        cards += adapters.cards(names[0], now())
        return Response(encode(ModelList(data=cards)), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return health_response(Health("draining", {"server": "shutting down"}))
        verdict = await client.health()
        if not verdict.serving:
            log.warning("unhealthy", status=verdict.status, unhealthy=verdict.unhealthy, degraded=verdict.degraded)
        return health_response(verdict)

    @app.get("/metrics")
    async def prometheus() -> Response:
        per_replica: list[SummaryReply] = []
        try:
            summary = await client.get_metrics()
            for replica in summary.replicas:  # a replica set: vLLM's engine label per replica
                per_replica.append(await client.get_metrics(replica=replica))
        except (TimeoutError, RuntimeError) as error:
            log.warning("metrics store unavailable for /metrics", error=str(error))
            summary, per_replica = None, []
        return Response(metrics.render(summary, per_replica), media_type=CONTENT_TYPE)

    add_lora_routes(app, adapters)
    add_extra_routes(app, state, health)  # tokenize, render, batch, SageMaker, development endpoints

    @app.get("/version")
    async def version() -> Response:
        return Response(encode({"version": __version__}), media_type="application/json")

    return app


def health_response(health: Health) -> Response:
    """``/health``: 200 with an empty body when all is well; 200 with
    ``{"status": "degraded", "degraded": {part: what}}`` while serving goes on without the bus or
    the metrics store; 503 in OpenAI's error shape plus ``status`` ("unavailable", "failed",
    "draining") and ``unhealthy`` (and ``degraded``, if any) while no request can be served."""
    if health.status == "ok":
        return Response(status_code=200)
    if health.serving:
        body: dict[str, object] = {"status": health.status, "degraded": health.degraded}
        return Response(encode(body), status_code=200, media_type="application/json")
    message = "; ".join(f"{part}: {problem}" for part, problem in health.unhealthy.items())
    body = error_body(f"unhealthy: {message}", 503)
    body["status"] = health.status
    body["unhealthy"] = health.unhealthy
    if health.degraded:
        body["degraded"] = health.degraded
    return Response(encode(body), status_code=503, media_type="application/json")


def server_state(app: FastAPI) -> ServerState:
    return app.state.server  # type: ignore[no-any-return]
