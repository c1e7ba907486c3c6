"""Structured outputs over HTTP: ``response_format`` (json_schema), vLLM's ``structured_outputs`` and the
older ``guided_*`` fields on both endpoints of a real server on the tiny model, outputs checked
against their constraint; bad specs are a 400 naming the field and the server keeps serving. And a
named tool call whose arguments the worker constrains to the tool's schema."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.support.server_helpers import served_url
from tests.support.tool_calls import ASK, TOOL_ID

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
CHAT = {"messages": [{"role": "user", "content": "Answer in JSON."}]}
COMPLETION = {"prompt": "Answer in JSON:"}


@pytest.fixture(scope="module")
def base_url(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_url(tiny_qwen3, tmp_path_factory.mktemp("structured_http"), "--served-model-name", "tiny",
                    "--max-model-len", "512", "--num-gpu-blocks-override", "256") as url:
        yield url


def post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/{path}", json={"model": "tiny", "max_tokens": 60, **body}, timeout=300)


def text_of(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    return choice["text"] if "text" in choice else choice["message"]["content"]


def test_every_spelling_constrains_both_endpoints(base_url: str) -> None:
    json_schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    for seed in range(2):
        for path, base in (("completions", COMPLETION), ("chat/completions", CHAT)):
            jsonschema.validate(json.loads(text_of(post(base_url, path, {**base, "seed": seed,
                                                                         "response_format": json_schema}))), SCHEMA)
            jsonschema.validate(json.loads(text_of(post(base_url, path, {**base, "seed": seed,
                                                                         "guided_json": SCHEMA}))), SCHEMA)
            assert re.fullmatch(r"[ab]{3}x", text_of(post(base_url, path, {**base, "seed": seed,
                                                                            "guided_regex": "[ab]{3}x"})))
            choice = text_of(post(base_url, path, {**base, "seed": seed,
                                                   "structured_outputs": {"choice": ["red", "green"]}}))
            assert choice in ("red", "green")
            assert text_of(post(base_url, path, {**base, "seed": seed, "guided_choice": ["only"]})) == "only"


@pytest.mark.parametrize("extra,param", [
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "no_such_key": 1}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "abc"}}, "structured_outputs"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_a_bad_constraint_is_a_400_naming_the_field_and_the_server_serves_on(
    base_url: str, extra: dict[str, Any], param: str
) -> None:
    for path, base in (("completions", COMPLETION), ("chat/completions", CHAT)):
        response = post(base_url, path, {**base, **extra})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text
    assert text_of(post(base_url, "completions", {**COMPLETION, "guided_choice": ["still here"]})) == "still here"


# --------------------------------------------------------------------------- a named tool call: the worker constrains
CITY = {"type": "function", "function": {"name": "forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}}


def test_a_named_tool_call_of_the_tiny_model_has_arguments_that_validate(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    for seed in range(5):
        reply = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[CITY], seed=seed, max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "forecast"}})
        (call,) = reply.choices[0].message.tool_calls or []
        assert call.function.name == "forecast" and TOOL_ID.match(call.id)
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == {"city", "days"} and arguments["city"] in ("Paris", "Oslo")
        assert type(arguments["days"]) is int and 1 <= arguments["days"] <= 9
