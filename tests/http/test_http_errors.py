"""Errors at the HTTP edge: each is one log line naming the request id and the path (the
traceback at debug level only), a 500 in OpenAI's shape, and the keep-alive connection stays open.
A real uvicorn server in this event loop over the fake scheduler (fake_served.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from starlette.requests import Request

from tests.support.fake_served import Env, env, served_app, tokenizer, uvicorn_serving  # noqa: F401
from vllm_actors.protocol.messages import AddRequest
from vllm_actors.runtime.log_setup import configure_logging
from vllm_actors.server.errors import edge_context
from vllm_actors.server.streaming import guarded_events


@pytest.fixture
def stderr_lines(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[[], list[str]]]:
    """The lines the project's structlog set-up writes, at INFO (the serve command's level)."""
    configure_logging("INFO")
    capsys.readouterr()
    try:
        yield lambda: [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    finally:
        configure_logging()


def _fail_adds(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    send = client.transport.send

    def failing(destination: str, message: Any) -> None:
        if isinstance(message, AddRequest):
            raise RuntimeError("injected\nfailure over\nthree lines")
        send(destination, message)

    monkeypatch.setattr(client.transport, "send", failing)


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: dict[str, Any],
                    request_id: str) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on an open connection; the status, headers and body of its answer."""
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 + f"X-Request-Id: {request_id}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines if h)}
    payload = await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1]), headers, payload


@pytest.mark.asyncio
async def test_a_500_is_one_line_naming_the_request_and_the_connection_stays_open(
    env: Env, monkeypatch: pytest.MonkeyPatch, stderr_lines: Callable[[], list[str]], caplog: pytest.LogCaptureFixture,  # noqa: F811
) -> None:
    async with served_app(env, monkeypatch) as (client, app), uvicorn_serving(app) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            _fail_adds(client, monkeypatch)
            with caplog.at_level(logging.DEBUG):
                for index in range(3):
                    status, headers, body = await _exchange(
                        reader, writer, {"prompt": "hi", "max_tokens": 2}, f"failing-{index}")
                    assert status == 500 and headers.get("connection") != "close"
                    assert json.loads(body)["error"]["type"] == "InternalServerError"
            monkeypatch.setattr(client.transport, "send", type(client.transport).send.__get__(client.transport))
            # The same connection serves the next request: the 500s did not drop it.
            status, _, body = await _exchange(reader, writer, {"prompt": "hi", "max_tokens": 2}, "served")
            assert status == 200, body
        finally:
            writer.close()
    lines = stderr_lines()
    failed = [line for line in lines if "request failed" in line]
    assert len(failed) == 3, lines
    for index, line in enumerate(failed):
        assert f"request_id=cmpl-failing-{index}" in line and "path=/v1/completions" in line
        assert "RuntimeError" in line and "Traceback" not in line
    assert not any("Traceback" in line or "injected" == line.strip() for line in lines), lines
    # uvicorn saw no exception (it would log its own traceback and close the connection).
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]
    assert client.num_unfinished == 0 and client.frontend.num_unfinished == 0


class _Stream:
    request_id = "s"

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def abort(self, reason: str = "abort") -> None:
        self.reasons.append(reason)


@pytest.mark.asyncio
async def test_a_stream_that_fails_logs_one_line_and_ends_with_an_error_event(
    stderr_lines: Callable[[], list[str]],
) -> None:
    async def events() -> AsyncIterator[bytes]:
        yield b"data: first\n\n"
        raise RuntimeError("broken\nmid-stream")

    request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions",
                       "headers": [(b"x-request-id", b"y" * 10_000)]})
    stream = _Stream()
    chunks = [chunk async for chunk in guarded_events(events(), [stream], request)]  # type: ignore[list-item]
    assert chunks[0] == b"data: first\n\n" and chunks[-1] == b"data: [DONE]\n\n"
    assert json.loads(chunks[1].removeprefix(b"data: "))["error"]["code"] == 500
    assert stream.reasons == ["error"]
    lines = stderr_lines()
    assert len(lines) == 1, lines
    assert "stream failed" in lines[0] and "path=/v1/chat/completions" in lines[0]
    assert "request_id=" + "y" * 64 + " " in lines[0] + " " and "y" * 65 not in lines[0]  # a long id, cut short


@pytest.mark.asyncio
async def test_the_traceback_is_there_at_debug_level(stderr_lines: Callable[[], list[str]]) -> None:
    configure_logging("DEBUG")

    async def events() -> AsyncIterator[bytes]:
        raise RuntimeError("boom")
        yield b""

    request = Request({"type": "http", "method": "POST", "path": "/p", "headers": []})
    async for _ in guarded_events(events(), [], request):
        pass
    text = "\n".join(stderr_lines())
    assert "stream failed: traceback" in text and "Traceback" in text


def test_a_path_or_an_id_cannot_forge_a_log_line() -> None:
    scope = {"type": "http", "path": "/v1/\n2026 [error] forged", "headers": [(b"x-request-id", b"a\tb")]}
    context = edge_context(scope)
    assert "\n" not in context["path"] and context["path"].startswith("/v1/\\n")
    assert context["request_id"] == "a\\tb"


def test_a_client_leaving_mid_body_is_no_error(stderr_lines: Callable[[], list[str]]) -> None:
    """A client that disconnects before its body is whole (Starlette raises ClientDisconnect from
    request.body()) gets nothing written back and logs no error line: found by the fuzzer, where
    it was logged as "request failed" and a 500 was sent to nobody."""
    from vllm_actors.server.errors import InternalErrorMiddleware

    async def endpoint(scope: Any, receive: Any, send: Any) -> None:
        await Request(scope, receive).body()
        raise AssertionError("the body cannot be whole")

    incoming = [{"type": "http.request", "body": b'{"prompt": ', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[Any] = []

    async def receive() -> Any:
        return incoming.pop(0)

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "query_string": b""}
    asyncio.run(InternalErrorMiddleware(endpoint)(scope, receive, send))
    assert sent == []
    assert not [line for line in stderr_lines() if "error" in line.lower()]
