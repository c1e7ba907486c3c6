"""vLLM's endpoints that command the engine (``EngineControl``, answered by the scheduler or the
workers' rank 0), in vLLM 0.26's shapes:

- development mode (``VLLM_SERVER_DEV_MODE=1``): ``POST /reset_prefix_cache`` ->
  ``{"success": bool}`` (false while requests hold KV blocks, unless ``reset_running_requests=true``
  preempts them first); ``POST /sleep?level=0|1|2&mode=abort|wait|keep`` and
  ``POST /wake_up[?tags=weights&tags=kv_cache&tags=scheduling]`` -> 200, empty;
  ``GET /is_sleeping`` -> ``{"is_sleeping": bool}``;
- with ``VLLM_TORCH_PROFILER_DIR`` set: ``POST /start_profile``, ``POST /stop_profile`` -> 200, empty.
"""

from __future__ import annotations

from typing import Any

import structlog
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from vllm_actors.envs import Envs, envs
from vllm_actors.protocol.messages import SLEEP_MODES, WAKE_TAGS, ControlReply
from vllm_actors.server.errors import OpenAIError, bad_request
from vllm_actors.server.protocol import encode
from vllm_actors.server.serving import ServerState

log = structlog.get_logger(__name__)


async def _command(state: ServerState, action: str, **fields: Any) -> ControlReply:
    try:
        reply = await state.client.control(action, **fields)
    except TimeoutError as error:
        raise OpenAIError(str(error), 503) from None
    if reply.error is not None:
        raise OpenAIError(f"{action}: {reply.error}", 500)
    return reply


def _json(body: dict[str, Any]) -> Response:
    return Response(encode(body), media_type="application/json")


def _flag(request: Request, name: str) -> bool:
    text = request.query_params.get(name, "false").lower()
    if text not in ("true", "false", "1", "0"):
        raise bad_request(f"{name}: must be true or false, got {text!r}", name)
    return text in ("true", "1")


def add_engine_routes(app: FastAPI, state: ServerState, settings: Envs = envs) -> None:
    """The development-mode commands where ``VLLM_SERVER_DEV_MODE`` is on; the profiler's where
    ``VLLM_TORCH_PROFILER_DIR`` is set (vLLM's gates)."""
    if settings.VLLM_SERVER_DEV_MODE:
        _add_dev_commands(app, state)
    if settings.VLLM_TORCH_PROFILER_DIR:
        log.warning("torch profiler enabled in the API server: use it for local development only",
                    directory=settings.VLLM_TORCH_PROFILER_DIR)

        async def start_profile(request: Request) -> Response:
            await _command(state, "start_profile")
            return Response(status_code=200)

        async def stop_profile(request: Request) -> Response:
            await _command(state, "stop_profile")
            return Response(status_code=200)

        app.add_api_route("/start_profile", start_profile, methods=["POST"], name="start_profile")
        app.add_api_route("/stop_profile", stop_profile, methods=["POST"], name="stop_profile")


def _add_dev_commands(app: FastAPI, state: ServerState) -> None:
    async def reset_prefix_cache(request: Request) -> Response:
        running = _flag(request, "reset_running_requests")
        _flag(request, "reset_external")  # no external (connector) cache here: nothing more to reset
        reply = await _command(state, "reset_prefix_cache", reset_running_requests=running)
        return _json({"success": reply.success})

    async def sleep(request: Request) -> Response:
        level_text = request.query_params.get("level", "1")
        if level_text not in ("0", "1", "2"):
            raise bad_request(f"level: must be 0, 1 or 2, got {level_text!r}", "level")
        mode = request.query_params.get("mode", "abort")
        if mode not in SLEEP_MODES:
            raise bad_request(f"mode: must be one of {', '.join(SLEEP_MODES)}, got {mode!r}", "mode")
        await _command(state, "sleep", level=int(level_text), mode=mode)
        return Response(status_code=200)

    async def wake_up(request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None  # none named: everything wakes
        unknown = [tag for tag in tags or () if tag not in WAKE_TAGS]
        if unknown:
            raise bad_request(f"tags: each must be one of {', '.join(WAKE_TAGS)}, got {unknown[0]!r}", "tags")
        await _command(state, "wake_up", tags=tags)
        return Response(status_code=200)

    async def is_sleeping(request: Request) -> Response:
        reply = await _command(state, "is_sleeping")
        return _json({"is_sleeping": reply.is_sleeping})

    app.add_api_route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"], name="reset_prefix_cache")
    app.add_api_route("/sleep", sleep, methods=["POST"], name="sleep")
    app.add_api_route("/wake_up", wake_up, methods=["POST"], name="wake_up")
    app.add_api_route("/is_sleeping", is_sleeping, methods=["GET"], name="is_sleeping")
