"""The OpenAI app over an AsyncEngineClient and a fake scheduler (no processes, no model): the
``env`` and ``tokenizer`` fixtures of fake_env.py, re-exported for the HTTP-edge tests."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from tests.support.fake_env import env, tokenizer
from tests.support.fake_scheduler import Env, wait_until_async
from vllm_actors.clients.async_client import AsyncEngineClient
from vllm_actors.server import build_app

__all__ = ["Env", "asgi", "env", "served_app", "tokenizer", "uvicorn_serving", "wait_until_async"]


def asgi(app: FastAPI) -> httpx.AsyncClient:
    """In-process HTTP; an exception the app lets out is a 500, as under a real server."""
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://app", timeout=30)


@contextlib.asynccontextmanager
async def served_app(env: Env, monkeypatch: pytest.MonkeyPatch,
                     **app_kwargs: Any) -> AsyncIterator[tuple[AsyncEngineClient, FastAPI]]:
    client = AsyncEngineClient(env.info, env.tokenizer, group=env.group, load_tokenizer=False)

    async def store_reachable(timeout: float) -> dict[str, str]:
        return {}  # no metrics store here: the bus round trip would time out

    async def no_store() -> object:
        raise TimeoutError("no metrics store in this test")  # /metrics renders without the store's figures

    monkeypatch.setattr(client._health, "store_reachable", store_reachable)
    monkeypatch.setattr(client, "get_metrics", no_store)
    try:
        yield client, build_app(client, served_model_names=["fake"], **app_kwargs)
    finally:
        await client.shutdown()


@contextlib.asynccontextmanager
async def uvicorn_serving(app: FastAPI) -> AsyncIterator[int]:
    """The app under a real uvicorn server in this event loop, on a loopback port bound here and
    handed over (no window in which another process could take it); yields the port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False))
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        await task
        listener.close()
