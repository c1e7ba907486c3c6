"""vLLM's development endpoints, registered only when ``VLLM_SERVER_DEV_MODE=1`` (vLLM's variable,
as vLLM does: they would let any client holding the API key read the server's configuration).
``GET /server_info?config_format=text|json``: ``{"vllm_config", "vllm_env", "system_env"}`` (the
engine config, the ``VLLM_*`` settings but keys, the platform), vLLM's shape. The commands to the
engine (``/reset_prefix_cache``, ``/sleep``, ``/wake_up``, ``/is_sleeping``, and the profiler's
under their own gate) are ``engine_routes.py``'s."""

from __future__ import annotations

import platform
import sys
from typing import Any

import msgspec
import structlog
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from vllm_actors import __version__
from vllm_actors.envs import Envs, envs
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.server.engine_routes import add_engine_routes
from vllm_actors.server.errors import bad_request
from vllm_actors.server.protocol import encode
from vllm_actors.server.serving import ServerState

log = structlog.get_logger(__name__)


def add_dev_routes(app: FastAPI, state: ServerState, settings: Envs = envs) -> None:
    """The development endpoints, where ``VLLM_SERVER_DEV_MODE`` turns them on (and the
    profiler's, where ``VLLM_TORCH_PROFILER_DIR`` does)."""
    add_engine_routes(app, state, settings)
    if not settings.VLLM_SERVER_DEV_MODE:
        return
    log.warning("SECURITY WARNING: development endpoints are enabled (VLLM_SERVER_DEV_MODE); "
                "do not use this in production")

    async def server_info(request: Request) -> Response:
        fmt = request.query_params.get("config_format", "text")
        if fmt not in ("text", "json"):
            raise bad_request(f"config_format: must be 'text' or 'json', got {fmt!r}", "config_format")
        config = engine_config(state)
        info = {
            "vllm_config": (repr(config) if fmt == "text" else msgspec.to_builtins(config)) if config else None,
            "vllm_env": vllm_env(settings),
            "system_env": system_env(),
        }
        return Response(encode(info), media_type="application/json")

    app.add_api_route("/server_info", server_info, methods=["GET"], name="server_info")


def engine_config(state: ServerState) -> EngineConfig | None:
    """The engine config of the group this server started (None: attached to another's)."""
    config = getattr(getattr(state.client, "group", None), "config", None)
    return config if isinstance(config, EngineConfig) else None


def vllm_env(settings: Envs) -> dict[str, Any]:
    """Every registered setting this process has a value for, keys left out (vLLM's rule)."""
    values: dict[str, Any] = {}
    for setting in Envs.settings():
        if "KEY" in setting.name or not settings.is_set(setting.name):
            continue
        value = getattr(settings, setting.name)
        values[setting.name] = value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
    return values


def system_env() -> dict[str, str]:
    import torch

    return {"vllm_actors_version": __version__, "python_version": sys.version.split()[0],
            "platform": platform.platform(), "torch_version": str(torch.__version__),
            "cuda_available": str(torch.cuda.is_available())}
