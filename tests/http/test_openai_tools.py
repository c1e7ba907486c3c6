"""Tools on ``/v1/chat/completions`` through the real app, with a fake scheduler
whose output the test writes (no model): the official ``openai`` client's typed models over tool
calls, streamed and not (tool_choice "auto" with the hermes parser, a named function,
"required"), the schema a forced call sends to the engine, "none", parallel_tool_calls, tools and
tool-call history reaching the chat template, and tool_choice's 400s. The end-to-end named call on
the tiny model, whose arguments must validate, is in test_structured_outputs_http.py (its server)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from fastapi import FastAPI

from tests.support.fake_scheduler import MAX_MODEL_LEN, Env, FakeGroup, FakeScheduler
from tests.support.fake_served import asgi, served_app, tokenizer  # noqa: F401
from tests.support.tool_calls import ASK, TOOL_ID
from vllm_actors.actors.frontend.tokenizer import Tokenizer
from vllm_actors.protocol.messages import AddRequest, RequestUpdate
from vllm_actors.runtime.run_dir import GroupInfo, make_addresses
from vllm_actors.server.serving import ServerOptions

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, CLOCK]
AUTO_OUTPUT = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
               '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
SEEN_TEMPLATE = ("{% if tools %}{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% endif %}"
                 "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
                 "({{ c.id }} {{ c.function.name }} city={{ c.function.arguments.city }}){% endfor %}"
                 "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}{% endfor %}")


class ScriptedScheduler(FakeScheduler):
    """Every request generates ``script`` (token ids), one token a tick, then EOS ("stop")."""

    script: list[int] = []  # noqa: RUF012  (set by the test before its request)
    eos = 0

    def _step(self) -> dict[bytes, list[RequestUpdate]]:
        out: dict[bytes, list[RequestUpdate]] = defaultdict(list)
        with self.lock:
            for request_id, running in list(self.requests.items()):
                position = len(running.outputs)
                if position < len(self.script):
                    running.outputs.append(self.script[position])
                    out[running.identity].append(RequestUpdate(request_id=request_id,
                                                               new_token_ids=[self.script[position]]))
                else:
                    out[running.identity].append(RequestUpdate(request_id=request_id, new_token_ids=[self.eos],
                                                               finish_reason="stop"))
                    del self.requests[request_id]
        return out


@pytest.fixture
def scripted(tokenizer: Tokenizer) -> Iterator[Env]:  # noqa: F811
    yield from scripted_env(tokenizer)


def scripted_env(tokenizer: Tokenizer) -> Iterator[Env]:  # noqa: F811
    """A ScriptedScheduler's Env over ``tokenizer`` (the body of a fixture: yields once)."""
    run_dir = Path(tempfile.mkdtemp(prefix="tl", dir="/tmp"))  # IPC paths must stay short
    addresses = make_addresses(run_dir, 1)
    info = GroupInfo(pid=0, run_dir=str(run_dir), model="fake", addresses=addresses,
                     worker={"eos_token_ids": [tokenizer.eos_token_id], "vocab_size": tokenizer.vocab_size},
                     max_model_len=MAX_MODEL_LEN, tokenizer=None)
    scheduler = ScriptedScheduler(addresses.scheduler)
    scheduler.eos = tokenizer.eos_token_id or 0
    try:
        yield Env(scheduler, FakeGroup(), info, tokenizer)
    finally:
        scheduler.close()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture
def constraints_honoured() -> None:
    """Structured outputs reach the (fake) scheduler, which records what it was sent: the frontend
    checks the tools' schema (structured outputs exist: nothing to stand in for any more)."""


def script(env: Env, text: str) -> None:
    ids = env.tokenizer.encode(text, add_special_tokens=False)
    assert env.tokenizer.decode(ids) == text
    env.scheduler.script = ids


@pytest_asyncio.fixture
async def app(scripted: Env, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FastAPI]:
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", trust_request_chat_template=True)
    async with served_app(scripted, monkeypatch, options=options) as (_, built):
        yield built


def client_of(app: FastAPI) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://app/v1", api_key="unused", http_client=asgi(app), max_retries=0)


def last_add(env: Env) -> AddRequest:
    return env.scheduler.received[-1]


# --------------------------------------------------------------------------- tool_choice "auto"
@pytest.mark.asyncio
async def test_auto_tool_calls_parse_with_the_openai_client(scripted: Env, app: FastAPI) -> None:
    script(scripted, AUTO_OUTPUT)
    client = client_of(app)
    reply = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    calls = choice.message.tool_calls or []
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", {"city": "Paris", "days": 2}), ("function", "now", {})]
    assert all(TOOL_ID.match(c.id) for c in calls) and calls[0].id != calls[1].id
    assert last_add(scripted).params.structured_outputs is None  # "auto": the model writes freely

    chunks = [chunk async for chunk in await client.chat.completions.create(
        model="fake", messages=ASK, tools=TOOLS, stream=True)]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    content = "".join(d.content or "" for d in deltas)
    assert content == "Let me look." and "<tool" not in content and "{" not in content
    pieces = [t for d in deltas for t in d.tool_calls or []]
    firsts = [t for t in pieces if t.id is not None]
    assert [(t.index, t.type, t.function.name) for t in firsts] == [
        (0, "function", "get_weather"), (1, "function", "now")]
    assert all(TOOL_ID.match(t.id or "") for t in firsts)
    for index in (0, 1):
        mine = [t for t in pieces if t.index == index]
        assert mine[0].id is not None and all(t.id is None and t.function.name is None for t in mine[1:])
        arguments = "".join(t.function.arguments or "" for t in mine)
        assert json.loads(arguments) == json.loads(calls[index].function.arguments)
    assert len(pieces) > 3  # the arguments came in fragments, as generated
    first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert all(not d.tool_calls for d in deltas[:first_call]) and "".join(
        d.content or "" for d in deltas[:first_call]) == "Let me look."  # content streamed before the call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.asyncio
async def test_token_ids_held_back_by_the_parser_still_stream(scripted: Env, app: FastAPI) -> None:
    script(scripted, AUTO_OUTPUT)
    client = client_of(app)
    whole = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS,
                                                 extra_body={"return_token_ids": True})
    chunks = [chunk async for chunk in await client.chat.completions.create(
        model="fake", messages=ASK, tools=TOOLS, stream=True, extra_body={"return_token_ids": True})]
    streamed = [i for c in chunks if c.choices for i in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed == (whole.choices[0].model_extra or {})["token_ids"] and len(streamed) > len(chunks) / 2


@pytest.mark.asyncio
async def test_parallel_tool_calls_false_keeps_the_first_call(scripted: Env, app: FastAPI) -> None:
    script(scripted, AUTO_OUTPUT)
    client = client_of(app)
    reply = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS,
                                                 parallel_tool_calls=False)
    assert [c.function.name for c in reply.choices[0].message.tool_calls or []] == ["get_weather"]
    chunks = [chunk async for chunk in await client.chat.completions.create(
        model="fake", messages=ASK, tools=TOOLS, stream=True, parallel_tool_calls=False)]
    assert {t.index for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []} == {0}


@pytest.mark.asyncio
async def test_text_without_tool_calls_is_content_and_none_leaves_markup_alone(scripted: Env, app: FastAPI) -> None:
    client = client_of(app)
    script(scripted, "Paris is sunny.")
    reply = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS)
    assert reply.choices[0].message.content == "Paris is sunny." and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"
    script(scripted, AUTO_OUTPUT)
    reply = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS,
                                                 tool_choice="none")
    assert reply.choices[0].message.content == AUTO_OUTPUT and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


# --------------------------------------------------------------------------- forced calls
@pytest.mark.asyncio
@pytest.mark.usefixtures("constraints_honoured")
async def test_a_named_function_sends_its_schema_and_returns_the_call(scripted: Env, app: FastAPI) -> None:
    client = client_of(app)
    named = {"type": "function", "function": {"name": "get_weather"}}
    script(scripted, '{"city": "Paris"}')
    reply = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS,
                                                 tool_choice=named)
    constraint = last_add(scripted).params.structured_outputs
    assert constraint is not None and json.loads(constraint.json or "") == WEATHER["function"]["parameters"]
    (call,) = reply.choices[0].message.tool_calls or []
    assert TOOL_ID.match(call.id) and call.function.name == "get_weather"
    assert call.function.arguments == '{"city": "Paris"}'
    assert reply.choices[0].finish_reason == "stop"  # vLLM's (and OpenAI's) for a named call

    chunks = [chunk async for chunk in await client.chat.completions.create(
        model="fake", messages=ASK, tools=TOOLS, tool_choice=named, stream=True)]
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id is not None and pieces[0].function.name == "get_weather"
    assert "".join(t.function.arguments or "" for t in pieces) == '{"city": "Paris"}'
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


@pytest.mark.asyncio
@pytest.mark.usefixtures("constraints_honoured")
async def test_required_sends_vllms_array_schema_and_returns_the_calls(scripted: Env, app: FastAPI) -> None:
    client = client_of(app)
    script(scripted, '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    reply = await client.chat.completions.create(model="fake", messages=ASK, tools=TOOLS,
                                                 tool_choice="required")
    constraint = last_add(scripted).params.structured_outputs
    assert constraint is not None
    schema = json.loads(constraint.json or "")
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [v["properties"]["name"]["enum"] for v in schema["items"]["anyOf"]] == [["get_weather"], ["now"]]
    calls = reply.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("now", {}), ("get_weather", {"city": "Oslo"})]
    assert reply.choices[0].finish_reason == "tool_calls"
    chunks = [chunk async for chunk in await client.chat.completions.create(
        model="fake", messages=ASK, tools=TOOLS, tool_choice="required", stream=True)]
    pieces = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name) for t in pieces if t.id] == [(0, "now"), (1, "get_weather")]
    assert "".join(t.function.arguments or "" for t in pieces if t.index == 1) == '{"city": "Oslo"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.asyncio
async def test_forced_calls_have_empty_content_and_none_when_cut_short(scripted: Env, app: FastAPI) -> None:
    """vLLM's: content "" (not null) beside a named or required call; output cut short (max_tokens)
    is not a call whose arguments are half a JSON text, and not content either."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with asgi(app) as http:
        for choice, whole, cut in ((named, '{"city": "Paris"}', '{"city'),
                                   ("required", '[{"name": "now", "parameters": {}}]', "[")):
            for text, calls in ((whole, 1), (cut, 0)):
                script(scripted, text)
                response = await http.post("/v1/chat/completions", json={
                    "model": "fake", "messages": ASK, "tools": TOOLS, "tool_choice": choice})
                message = response.json()["choices"][0]["message"]
                assert message["content"] == "" and len(message.get("tool_calls", [])) == calls, (choice, message)


# --------------------------------------------------------------------------- the template and the history
@pytest.mark.asyncio
async def test_tools_and_tool_call_history_reach_the_chat_template(scripted: Env, app: FastAPI) -> None:
    script(scripted, "It is sunny.")
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]
    async with asgi(app) as http:
        response = await http.post("/v1/chat/completions", json={
            "model": "fake", "messages": history, "tools": TOOLS, "chat_template": SEEN_TEMPLATE,
            "return_prompt_text": True})
    assert response.status_code == 200, response.text
    assert response.json()["prompt_text"] == ("[get_weather][now]<user>Weather in Paris?<assistant>"
                                              "(call-1 get_weather city=Paris)<tool>sunny#call-1")
    assert response.json()["choices"][0]["message"]["content"] == "It is sunny."


# --------------------------------------------------------------------------- 400s
BAD_CHOICES: list[tuple[dict[str, Any], str]] = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "does not match"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.function"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "invalid value"),
    ({"tool_choice": "required"}, "`tools` must be set"),
    ({"tools": []}, "must not be an empty array"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}},
      "response_format": {"type": "json_object"}}, "not both"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("extra", "message"), BAD_CHOICES)
async def test_bad_tool_choices_are_a_400_naming_the_field(app: FastAPI, extra: dict[str, Any], message: str) -> None:
    async with asgi(app) as http:
        response = await http.post("/v1/chat/completions", json={"model": "fake", "messages": ASK, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] in ("tools", "tool_choice")


@pytest.mark.asyncio
async def test_auto_needs_the_servers_flags_as_in_vllm(scripted: Env, monkeypatch: pytest.MonkeyPatch) -> None:
    async with served_app(scripted, monkeypatch) as (_, plain), asgi(plain) as http:
        for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
            response = await http.post("/v1/chat/completions", json={"model": "fake", "messages": ASK, **body})
            assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
            assert "--enable-auto-tool-choice and --tool-call-parser" in response.json()["error"]["message"]
        script(scripted, "fine")
        response = await http.post("/v1/chat/completions", json={"model": "fake", "messages": ASK, "tools": TOOLS,
                                                                  "tool_choice": "none"})
        assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "fine"


def test_serve_refuses_auto_tool_choice_without_a_parser() -> None:
    from vllm_actors.server.serve import run_serve

    args = type("Args", (), {"enable_auto_tool_choice": True, "tool_call_parser": None, "model_tag": "m",
                             "model": None})()
    with pytest.raises(ValueError, match="requires --tool-call-parser"):
        run_serve(args, {})




# --------------------------------------------------------------------------- junk never a 500
JUNK: list[dict[str, Any]] = [
    {"tools": [1]}, {"tools": ["x"]}, {"tools": [{"function": 1}]}, {"tools": {"a": 1}}, {"tools": "str"},
    {"tools": TOOLS, "tool_choice": [1]}, {"tools": TOOLS, "tool_choice": 5},
    {"tools": TOOLS, "tool_choice": {"function": "x"}},
    {"tools": TOOLS, "tool_choice": {"type": "other", "function": {"name": "now"}}},
    {"messages": [{"role": "assistant", "tool_calls": 5}]},
    {"messages": [{"role": "assistant", "tool_calls": [1]}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]},
    {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 100_000}}]}]},
]


@pytest.mark.asyncio
@pytest.mark.parametrize("extra", JUNK)
async def test_junk_tools_are_a_400(app: FastAPI, extra: dict[str, Any]) -> None:
    async with asgi(app) as http:
        response = await http.post("/v1/chat/completions", json={"model": "fake", "messages": ASK, **extra})
    assert response.status_code == 400, response.text
