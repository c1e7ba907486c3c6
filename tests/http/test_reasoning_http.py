"""--reasoning-parser through the app, with a scripted (fake) scheduler writing the model's output
(no model): the thinking in ``message.reasoning`` and in ``reasoning`` deltas, the content after it,
tool calls parsed from the content only, include_reasoning false, enable_thinking false, and a
structured-output constraint sent to start after </think>. A real server's reasoning runs in the
pinned pairs (vllm_pairs/reasoning.json)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
from fastapi import FastAPI

from tests.http.test_openai_tools import TOOLS, scripted_env
from tests.support.fake_scheduler import Env
from tests.support.fake_served import asgi, served_app
from tests.support.tiny_models import THINK_TOKENS, build_tokenizer
from tests.support.tool_calls import ASK
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer
from vllm_actors.server.serving import ServerOptions

THOUGHT = "Let me think about Paris."
OUTPUT = f"<think>{THOUGHT}</think>It is sunny."


@pytest.fixture(scope="module")
def think_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("think_tokenizer")
    build_tokenizer(path, THINK_TOKENS)
    return load_tokenizer(path)


@pytest.fixture
def scripted(think_tokenizer: Tokenizer) -> Iterator[Env]:
    yield from scripted_env(think_tokenizer)


@pytest_asyncio.fixture(params=["qwen3", "deepseek_r1"])
async def app(request: pytest.FixtureRequest, scripted: Env, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FastAPI]:
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser=request.param)
    async with served_app(scripted, monkeypatch, options=options) as (_, built):
        yield built


def script(env: Env, text: str) -> None:
    env.scheduler.script = env.tokenizer.encode(text, add_special_tokens=False)


async def chat(app: FastAPI, **extra: Any) -> dict[str, Any]:
    async with asgi(app) as http:
        response = await http.post("/v1/chat/completions", json={"model": "fake", "messages": ASK, **extra})
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


async def stream(app: FastAPI, **extra: Any) -> list[dict[str, Any]]:
    async with asgi(app) as http:
        response = await http.post("/v1/chat/completions", json={"model": "fake", "messages": ASK, "stream": True,
                                                                   **extra})
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def joined(chunks: list[dict[str, Any]], key: str) -> str:
    return "".join(c["choices"][0]["delta"].get(key) or "" for c in chunks if c["choices"])


@pytest.mark.asyncio
async def test_the_thinking_is_its_own_field_streamed_or_not(scripted: Env, app: FastAPI) -> None:
    script(scripted, OUTPUT)
    message = (await chat(app))["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (THOUGHT, "It is sunny.")
    chunks = await stream(app)
    assert (joined(chunks, "reasoning"), joined(chunks, "content")) == (THOUGHT, "It is sunny.")
    deltas = [c["choices"][0]["delta"] for c in chunks[1:] if c["choices"]]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("content" not in d for d in deltas[:first_content])  # reasoning deltas carry no content
    assert all("reasoning" not in d for d in deltas[first_content:])
    assert not any("think>" in (d.get("content") or "") + (d.get("reasoning") or "") for d in deltas)
    script(scripted, THOUGHT)  # cut short while thinking: all reasoning, no content
    message = (await chat(app))["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (THOUGHT, None)


@pytest.mark.asyncio
async def test_include_reasoning_false_drops_it(scripted: Env, app: FastAPI) -> None:
    script(scripted, OUTPUT)
    message = (await chat(app, include_reasoning=False))["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (None, "It is sunny.")
    chunks = await stream(app, include_reasoning=False)
    assert (joined(chunks, "reasoning"), joined(chunks, "content")) == ("", "It is sunny.")


@pytest.mark.asyncio
async def test_tool_calls_come_from_the_content_after_the_thinking(scripted: Env, app: FastAPI) -> None:
    call = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    script(scripted, f"<think>I could write {call} here</think>{call}")
    reply = await chat(app, tools=TOOLS)
    message = reply["choices"][0]["message"]
    assert message["reasoning"] == f"I could write {call} here"
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["now"] and message["content"] is None
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    chunks = await stream(app, tools=TOOLS)
    calls = [t for c in chunks if c["choices"] for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [t["function"]["name"] for t in calls if t.get("id")] == ["now"]
    assert joined(chunks, "reasoning") == f"I could write {call} here"


@pytest.mark.asyncio
async def test_structured_outputs_start_after_the_thinking(scripted: Env, app: FastAPI) -> None:
    script(scripted, OUTPUT)
    end = scripted.tokenizer.token_to_id("</think>")
    await chat(app, structured_outputs={"regex": "[a-z ]+"})
    constraint = scripted.scheduler.received[-1].params.structured_outputs
    assert constraint is not None and constraint.regex == "[a-z ]+" and constraint.start_after == end
    named = {"type": "function", "function": {"name": "now"}}
    await chat(app, tools=TOOLS, tool_choice=named)
    constraint = scripted.scheduler.received[-1].params.structured_outputs
    assert constraint is not None and constraint.start_after == end


@pytest.mark.asyncio
async def test_qwen3_without_thinking_is_content_and_constrained_from_the_start(scripted: Env,
                                                                                app: FastAPI) -> None:
    script(scripted, "It is sunny.")
    qwen3 = app.state.server.reasoning.name == "qwen3"
    message = (await chat(app, chat_template_kwargs={"enable_thinking": False},
                          structured_outputs={"regex": "[A-Za-z .]+"}))["choices"][0]["message"]
    constraint = scripted.scheduler.received[-1].params.structured_outputs
    if qwen3:
        assert (message["reasoning"], message["content"]) == (None, "It is sunny.")
        assert constraint is not None and constraint.start_after is None
    else:  # deepseek_r1 has no switch: still thinking
        assert (message["reasoning"], message["content"]) == ("It is sunny.", None)
        assert constraint is not None and constraint.start_after is not None
    chunks = await stream(app, reasoning_effort="none")
    assert bool(joined(chunks, "content")) == qwen3
