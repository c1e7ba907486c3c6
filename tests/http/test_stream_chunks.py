"""A stream sends each engine step's text as it comes, not at the end (completions and chat), one
chunk per step and choice, as vLLM: a token of no text of its own gets its chunk (text ""), and a
server that fell behind its engine still sends each step apart.

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

from tests.support.fake_scheduler import expected_tokens, wait_until, wait_until_async
from tests.support.fake_served import Env, env, served_app, tokenizer, uvicorn_serving  # noqa: F401

STEPS = 6


async def data_events(response: httpx.Response) -> AsyncIterator[dict[str, Any] | str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


async def paced_stream(env: Env, port: int, path: str, body: dict[str, Any],  # noqa: F811
                       text_of: Callable[[dict[str, Any]], str | None]) -> tuple[list[str], list[dict[str, Any]]]:
    """Reads the stream, allowing one engine step after each chunk of a step (``text_of`` not None:
    its text, "" included); the steps' texts and every event."""
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
            if text is not None:
                texts.append(text)
                env.scheduler.allow()  # the next step only after this one's chunk arrived
    return texts, events


def completion_text(event: dict[str, Any]) -> str | None:
    return event["choices"][0]["text"] if event["choices"] else None


def chat_text(event: dict[str, Any]) -> str | None:
    delta = event["choices"][0]["delta"] if event["choices"] else {"role": "none"}
    return None if "role" in delta else delta.get("content")


@pytest.mark.asyncio
async def test_each_step_is_its_own_chunk_in_completions_and_chat(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    env.scheduler.pace()
    async with served_app(env, monkeypatch) as (_, app), uvicorn_serving(app) as port:
        prompt = "Hello there"
        texts, events = await paced_stream(
            env, port, "/v1/completions",
            {"model": "fake", "prompt": prompt, "max_tokens": STEPS, "ignore_eos": True},
            completion_text)
        prompt_ids = env.tokenizer.encode(prompt)
        assert len(texts) == STEPS, texts  # one chunk per step, none merged
        assert "".join(texts) == env.tokenizer.decode(expected_tokens(prompt_ids, STEPS))
        assert events[-1]["choices"][0]["finish_reason"] == "length"

        texts, events = await paced_stream(
            env, port, "/v1/chat/completions",
            {"model": "fake", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": STEPS,
             "ignore_eos": True},
            chat_text)
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert len(texts) == STEPS, texts
        assert events[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.asyncio
async def test_a_token_of_no_text_gets_its_chunk(env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """"é" is two byte tokens here: the first decodes to nothing yet, and its chunk says "" (vLLM's)."""
    accent = env.tokenizer.encode("é")
    assert len(accent) == 2
    script = env.tokenizer.encode("Hi ") + accent + env.tokenizer.encode("!")
    env.scheduler.script(script)
    env.scheduler.pace()
    body = {"model": "fake", "max_tokens": len(script), "ignore_eos": True}
    async with served_app(env, monkeypatch) as (_, app), uvicorn_serving(app) as port:
        for path, extra, text_of in (("/v1/completions", {"prompt": "x"}, completion_text),
                                     ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]},
                                      chat_text)):
            texts, events = await paced_stream(env, port, path, {**body, **extra}, text_of)
            assert len(texts) == len(script), (path, texts)  # chunks == tokens
            assert "" in texts and "".join(texts) == "Hi é!"
            assert events[-1]["choices"][0]["finish_reason"] == "length"


async def held_stream(env: Env, port: int, path: str, body: dict[str, Any],  # noqa: F811
                      text_of: Callable[[dict[str, Any]], str | None]) -> list[str]:
    """The stream of a request whose every step was sent while this event loop (the server's and
    the client's) was held: the server finds them all waiting at once. The steps' texts."""
    texts: list[str] = []
    received = len(env.scheduler.received)
    sent = env.scheduler.steps_sent
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http, \
            http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        await wait_until_async(lambda: len(env.scheduler.received) > received)  # the request is in
        env.scheduler.allow(STEPS)
        wait_until(lambda: env.scheduler.steps_sent >= sent + STEPS)  # blocks the loop: nothing read meanwhile
        async for event in data_events(response):
            if event == "[DONE]":
                break
            assert isinstance(event, dict)
            text = text_of(event)
            if text is not None:
                texts.append(text)
    return texts


@pytest.mark.asyncio
async def test_a_server_behind_its_engine_still_sends_a_chunk_per_step(
        env: Env, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    env.scheduler.pace()
    body = {"model": "fake", "max_tokens": STEPS, "ignore_eos": True}
    async with served_app(env, monkeypatch) as (_, app), uvicorn_serving(app) as port:
        texts = await held_stream(env, port, "/v1/completions", {**body, "prompt": "Hello there", "n": 2},
                                  completion_text)
        assert len(texts) == 2 * STEPS, texts  # per step and choice
        texts = await held_stream(env, port, "/v1/chat/completions",
                                  {**body, "messages": [{"role": "user", "content": "Hi"}]}, chat_text)
        assert len(texts) == STEPS, texts
