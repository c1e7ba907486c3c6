"""A stream sends each engine step's text as it comes, not at the end (completions and chat).

The fake scheduler (fake_served.py) is paced: it makes one step only when the test allows it, and
the test allows the next step only once the chunk of the last one has arrived over a real HTTP
connection. So the test waits on events, never on the clock: a slow machine cannot merge two steps
into one chunk, and a fast one cannot finish before the client reads (the real-model streaming test
in test_server.py checks only the text, since there the engine may outrun the client)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from tests.support.fake_scheduler import expected_tokens
from tests.support.fake_served import Env, env, served_app, tokenizer, uvicorn_serving  # noqa: F401

STEPS = 6


async def data_events(response: httpx.Response) -> AsyncIterator[dict[str, Any] | str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


async def paced_stream(env: Env, port: int, path: str, body: dict[str, Any],  # noqa: F811
                       text_of: Callable[[dict[str, Any]], str | None]) -> tuple[list[str], list[dict[str, Any]]]:
    """Reads the stream, allowing one engine step after each chunk with text; the texts and events."""
    texts: list[str] = []
    events: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http, \
            http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        env.scheduler.allow()
        async for event in data_events(response):
            if event == "[DONE]":
                break
            assert isinstance(event, dict)
            events.append(event)
            text = text_of(event)
            if text:
                texts.append(text)
                env.scheduler.allow()  # the next step only after this one's chunk arrived
    return texts, events


@pytest.mark.asyncio
async def test_each_step_is_its_own_chunk_in_completions_and_chat(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    env.scheduler.pace()
    async with served_app(env, monkeypatch) as (_, app), uvicorn_serving(app) as port:
        prompt = "Hello there"
        texts, events = await paced_stream(
            env, port, "/v1/completions",
            {"model": "fake", "prompt": prompt, "max_tokens": STEPS, "ignore_eos": True},
            lambda event: event["choices"][0]["text"] if event["choices"] else "")
        prompt_ids = env.tokenizer.encode(prompt)
        assert len(texts) == STEPS, texts  # one chunk per step, none merged
        assert "".join(texts) == env.tokenizer.decode(expected_tokens(prompt_ids, STEPS))
        assert events[-1]["choices"][0]["finish_reason"] == "length"

        texts, events = await paced_stream(
            env, port, "/v1/chat/completions",
            {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": STEPS,
             "ignore_eos": True},
            lambda event: event["choices"][0]["delta"].get("content") if event["choices"] else "")
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert len(texts) == STEPS, texts
        assert events[-1]["choices"][0]["finish_reason"] == "length"
