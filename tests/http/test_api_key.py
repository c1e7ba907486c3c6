"""``--api-key`` / ``VLLM_API_KEY`` / ``build_app(api_key=...)``: without
``Authorization: Bearer <key>`` every endpoint but ``/health`` answers 401 in OpenAI's error shape;
with it, requests are served. In process over the fake scheduler (fake_served.py), then once for
real through ``vllm-actors serve``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.routing import Route

from tests.support.fake_served import Env, asgi, env, served_app, tokenizer  # noqa: F401
from tests.support.server_helpers import free_port, start_server, stop_process, tail, wait_healthy
from vllm_actors.server.auth import api_keys_from

KEY = "sk-test-0123456789"
COMPLETION = {"prompt": "Hello there", "max_tokens": 2}


def routes(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves (the OpenAPI docs included), and one it does not."""
    found = [("GET", "/no/such/route")]
    for route in app.routes:
        if isinstance(route, APIRoute | Route):
            found += [(method, route.path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return found


def assert_unauthorized(reply: httpx.Response) -> None:
    assert reply.status_code == 401, (reply.request.url, reply.status_code, reply.text)
    error = reply.json()["error"]
    assert error["code"] == 401 and error["type"] == "UnauthorizedError" and "API key" in error["message"]
    assert reply.headers["www-authenticate"] == "Bearer"


WRONG = [None, "Bearer wrong-key", f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Basic {KEY}", KEY, "Bearer ", "",
         f"Token {KEY}"]


@pytest.mark.asyncio
async def test_without_the_key_every_endpoint_but_health_is_401(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async with served_app(env, monkeypatch, api_key=KEY) as (client, app):
        every = routes(app)
        assert {path for _, path in every} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/metrics",
                                               "/version", "/health", "/openapi.json", "/docs"}
        async with asgi(app) as http:
            for method, path in every:
                for authorization in WRONG:
                    headers = {} if authorization is None else {"Authorization": authorization}
                    reply = await http.request(method, path, headers=headers, json=COMPLETION)
                    if path == "/health":
                        assert reply.status_code == 200, reply.text
                    else:
                        assert_unauthorized(reply)
            assert client.num_unfinished == 0 and not env.scheduler.received  # nothing reached the engine


@pytest.mark.asyncio
async def test_with_the_key_requests_are_served(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async with served_app(env, monkeypatch, api_key=["other-key", KEY]) as (_, app):
        async with asgi(app) as http:
            for authorization in (f"Bearer {KEY}", f"bearer {KEY}", "Bearer other-key"):
                headers = {"Authorization": authorization}
                assert (await http.get("/v1/models", headers=headers)).json()["data"][0]["id"] == "fake"
                reply = await http.post("/v1/completions", headers=headers, json=COMPLETION)
                assert reply.status_code == 200, reply.text
                for path in ("/metrics", "/version", "/openapi.json"):
                    assert (await http.get(path, headers=headers)).status_code == 200, path
            # A bad request with the key is the usual 400, not a 401.
            reply = await http.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                                    json={**COMPLETION, "n": 0})
            assert reply.status_code == 400


@pytest.mark.asyncio
async def test_a_mounted_app_keeps_its_health_open(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async with served_app(env, monkeypatch, api_key=KEY) as (_, app):
        host = FastAPI()
        host.mount("/llm", app)
        async with asgi(host) as http:
            assert (await http.get("/llm/health")).status_code == 200
            assert_unauthorized(await http.get("/llm/v1/models"))
            assert_unauthorized(await http.get("/llm/health/../v1/models"))
            reply = await http.get("/llm/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            assert reply.status_code == 200


@pytest.mark.asyncio
async def test_without_a_key_nothing_is_asked(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    async with served_app(env, monkeypatch) as (_, app):
        async with asgi(app) as http:
            assert (await http.get("/v1/models")).status_code == 200


def test_the_flag_then_the_environment_decide_the_keys() -> None:
    from vllm_actors.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "m"]).api_key is None
    assert parser.parse_args(["serve", "m", "--api-key", "a", "b"]).api_key == ["a", "b"]
    assert api_keys_from(["a"], {"VLLM_API_KEY": "env"}) == ["a"]  # the flag wins, as in vLLM
    assert api_keys_from(None, {"VLLM_API_KEY": "env"}) == ["env"]
    assert api_keys_from(None, {}) == [] and api_keys_from(None, {"VLLM_API_KEY": ""}) == []
    with pytest.raises(ValueError, match="must not be empty"):
        api_keys_from([""], {})


def test_serve_with_vllm_api_key(tiny_qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    port, log_path = free_port(), tmp_path / "server.log"
    process: subprocess.Popen[bytes] = start_server(tiny_qwen3, port, log_path, tmp_path / "runs",
                                                    "--max-model-len", "128", "--num-gpu-blocks-override", "64")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, process, log_path)  # /health: no key needed
        assert_unauthorized(httpx.get(f"{base}/v1/models", timeout=30))
        assert_unauthorized(httpx.post(f"{base}/v1/completions", json=COMPLETION,
                                       headers={"Authorization": "Bearer nope"}, timeout=30))
        reply = httpx.post(f"{base}/v1/completions", json=COMPLETION, headers={"Authorization": f"Bearer {KEY}"},
                           timeout=60)
        assert reply.status_code == 200, reply.text
    finally:
        stop_process(process)
    assert process.returncode == 0, tail(log_path)
    assert KEY not in log_path.read_text(errors="replace")  # the key is never logged
