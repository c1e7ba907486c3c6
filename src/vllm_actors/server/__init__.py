"""The OpenAI-compatible HTTP server: ``build_app(client)`` (a FastAPI app to serve or to mount)
and the ``vllm-actors serve`` runtime. Importing the package imports nothing heavy."""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "AsyncEngineClient"]


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from vllm_actors.server.app import build_app

        return build_app
    if name == "AsyncEngineClient":
        from vllm_actors.clients.async_client import AsyncEngineClient

        return AsyncEngineClient
    raise AttributeError(f"module 'vllm_actors.server' has no attribute {name!r}")
