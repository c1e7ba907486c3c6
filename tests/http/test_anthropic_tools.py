"""Tool calls the model writes itself (tool_choice auto, the hermes parser) on ``/v1/messages``,
through the real app over a fake scheduler whose output the test writes (test_openai_tools'):
the ``anthropic`` client gets the text and both ``tool_use`` blocks, streamed (``input_json_delta``)
and not, with ``stop_reason: "tool_use"``; the tools reach the engine as the chat path's."""

from __future__ import annotations

import json

import anthropic
import httpx2
import pytest
from fastapi import FastAPI

from tests.http.test_openai_tools import AUTO_OUTPUT, app, script, scripted  # noqa: F401
from tests.support.fake_scheduler import Env
from tests.support.fake_served import tokenizer  # noqa: F401

TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}},
         {"name": "now", "input_schema": {"type": "object", "properties": {}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CALLS = [("get_weather", {"city": "Paris", "days": 2}), ("now", {})]


def client_of(built: FastAPI) -> anthropic.AsyncAnthropic:
    """The client over the app in process (the SDK runs on httpx2, a fork of httpx)."""
    http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=built), base_url="http://app", timeout=30)
    return anthropic.AsyncAnthropic(base_url="http://app", api_key="unused", http_client=http, max_retries=0)


@pytest.mark.asyncio
async def test_auto_tool_calls_become_tool_use_blocks(scripted: Env, app: FastAPI) -> None:  # noqa: F811
    script(scripted, AUTO_OUTPUT)
    client = client_of(app)
    reply = await client.messages.create(model="fake", max_tokens=200, messages=ASK, tools=TOOLS)
    assert reply.stop_reason == "tool_use"
    assert [block.type for block in reply.content] == ["text", "tool_use", "tool_use"]
    assert reply.content[0].type == "text" and reply.content[0].text == "Let me look."
    uses = [block for block in reply.content if block.type == "tool_use"]
    assert [(block.name, block.input) for block in uses] == CALLS and uses[0].id != uses[1].id

    async with client.messages.stream(model="fake", max_tokens=200, messages=ASK, tools=TOOLS) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    assert final.stop_reason == "tool_use" and [block.type for block in final.content] == ["text", "tool_use",
                                                                                           "tool_use"]
    assert [(block.name, block.input) for block in final.content if block.type == "tool_use"] == CALLS
    pieces = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
    assert len(pieces) > 2  # the arguments came in fragments, as generated
    assert json.loads("".join(e.delta.partial_json for e in pieces if e.index == 1)) == CALLS[0][1]


@pytest.mark.asyncio
async def test_text_without_markup_is_a_text_block_and_none_keeps_the_markup(scripted: Env,  # noqa: F811
                                                                            app: FastAPI) -> None:  # noqa: F811
    client = client_of(app)
    script(scripted, "Paris is sunny.")
    reply = await client.messages.create(model="fake", max_tokens=200, messages=ASK, tools=TOOLS)
    assert [(block.type, getattr(block, "text", None)) for block in reply.content] == [("text", "Paris is sunny.")]
    assert reply.stop_reason == "end_turn"
    script(scripted, AUTO_OUTPUT)
    reply = await client.messages.create(model="fake", max_tokens=200, messages=ASK, tools=TOOLS,
                                         tool_choice={"type": "none"})
    assert reply.content[0].type == "text" and reply.content[0].text == AUTO_OUTPUT
    assert reply.stop_reason == "end_turn"
