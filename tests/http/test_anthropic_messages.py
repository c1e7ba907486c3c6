"""Anthropic's Messages API through ``vllm-actors serve`` on the tiny model, with the official
``anthropic`` client: ``messages.create`` streamed and not (the same greedy text both ways),
``messages.stream``, ``count_tokens`` (equal to the usage's input tokens), a forced tool call and
its tool_result round trip, the stop_sequence and max_tokens stop reasons, the errors in
Anthropic's shape, the API key from ``x-api-key``; then the pinned vLLM pairs of
``vllm_pairs/anthropic_messages.json``, on this module's one server (started with its flags)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.server_helpers import served_url
from tests.support.vllm_pairs import Pair, load_pairs, run_pair

PAIRS = json.loads((Path(__file__).parent / "vllm_pairs" / "anthropic_messages.json").read_text())
MODULE_PAIRS = load_pairs(module="test_anthropic_messages")  # run on this module's server
KEY = PAIRS["serve_args"][PAIRS["serve_args"].index("--api-key") + 1]
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}
# A reply the grammar allows in one spelling only: the stop sequence and max_tokens cut it at known places.
GREEDY = {"temperature": 0}  # the client (2.14) names no temperature: sent as an extra field
PARIS = {"format": {"type": "json_schema", "schema": {"type": "string", "enum": ["Paris"]}}}


@pytest.fixture(scope="module")
def base_url(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_url(tiny_qwen3, tmp_path_factory.mktemp("anthropic_http"), "--served-model-name", "tiny",
                    *PAIRS["serve_args"]) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=KEY, max_retries=0, timeout=300)


def test_create_stream_and_count_tokens_agree(client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": "tiny", "max_tokens": 12, "system": "Be brief.", "messages": ASK,
                              "extra_body": GREEDY}
    reply = client.messages.create(**kwargs)
    assert (reply.type, reply.role, reply.model) == ("message", "assistant", "tiny")
    assert reply.id.startswith("chatcmpl-")
    assert reply.content[0].type == "text" and reply.stop_reason in ("end_turn", "max_tokens")
    assert 0 < reply.usage.output_tokens <= 12
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=ASK)
    assert counted.input_tokens == reply.usage.input_tokens > 0
    text = "".join(block.text for block in reply.content if block.type == "text")
    assert text  # the tiny model's greedy reply: a few characters

    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text and final.stop_reason == reply.stop_reason
    assert (final.usage.input_tokens, final.usage.output_tokens) == (reply.usage.input_tokens,
                                                                     reply.usage.output_tokens)
    kinds = [event.type for event in client.messages.create(**kwargs, stream=True)]
    assert kinds[:2] == ["message_start", "content_block_start"] and set(kinds[2:-3]) == {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequence_and_max_tokens_stop_reasons(client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model="tiny", max_tokens=40, messages=ASK, output_config=PARIS)
    assert whole.content[0].type == "text" and json.loads(whole.content[0].text) == "Paris"
    assert (whole.stop_reason, whole.stop_sequence) == ("end_turn", None)
    stopped = client.messages.create(model="tiny", max_tokens=40, messages=ASK, stop_sequences=["ris"],
                                     output_config=PARIS)
    assert stopped.content[0].type == "text" and stopped.content[0].text.endswith("Pa")
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "ris")
    cut = client.messages.create(model="tiny", max_tokens=1, messages=ASK, output_config=PARIS)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 1
    with client.messages.stream(model="tiny", max_tokens=40, messages=ASK, stop_sequences=["ris"],
                                output_config=PARIS) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "ris")


def test_a_forced_tool_call_and_its_result_round_trip(client: anthropic.Anthropic) -> None:
    reply = client.messages.create(model="tiny", max_tokens=80, messages=ASK, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert reply.stop_reason == "tool_use"
    (call,) = [block for block in reply.content if block.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input, dict) and isinstance(call.input["city"], str)

    with client.messages.stream(model="tiny", max_tokens=80, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        partial = "".join(e.delta.partial_json for e in stream if e.type == "content_block_delta"
                          and e.delta.type == "input_json_delta")
        final = stream.get_final_message()
    (streamed,) = [block for block in final.content if block.type == "tool_use"]
    assert json.loads(partial) == streamed.input == call.input and final.stop_reason == "tool_use"

    history: list[Any] = [*ASK, {"role": "assistant", "content": reply.content},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                        "content": "Sunny, 20 C"}]}]
    answer = client.messages.create(model="tiny", max_tokens=4, messages=history, tools=[WEATHER],
                                    tool_choice={"type": "none"})
    assert answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    longer = client.messages.count_tokens(model="tiny", messages=history, tools=[WEATHER])
    assert longer.input_tokens == answer.usage.input_tokens
    assert longer.input_tokens > client.messages.count_tokens(model="tiny", messages=ASK).input_tokens


def test_errors_in_anthropics_shape(client: anthropic.Anthropic, base_url: str) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", max_tokens=4, messages=ASK)
    assert missing.value.body == {"type": "error", "error": {
        "type": "NotFoundError", "message": "The model `claude-nope` does not exist."}}
    for body, field in [({"messages": ASK}, "max_tokens"), ({"max_tokens": 0, "messages": ASK}, "max_tokens"),
                        ({"max_tokens": 4, "messages": ASK, "temperature": -1}, "temperature"),
                        ({"max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]}, "messages"),
                        ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "tool"}},
                         "tool_choice"),
                        ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER],
                          "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice")]:
        reply = httpx.post(f"{base_url}/v1/messages", json={"model": "tiny", **body}, headers={"x-api-key": KEY},
                           timeout=60)
        assert reply.status_code == 400, (body, reply.text)
        error = reply.json()
        assert error["type"] == "error" and error["error"]["type"] == "BadRequestError", error
        assert field in error["error"]["message"], error
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="tiny", messages=[{"role": "robot", "content": "hi"}])


def test_the_api_key_from_x_api_key_or_bearer_on_these_routes_only(base_url: str) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=2, messages=ASK)
    bearer = anthropic.Anthropic(base_url=base_url, auth_token=KEY, max_retries=0)  # Authorization: Bearer
    assert bearer.messages.count_tokens(model="tiny", messages=ASK).input_tokens > 0
    chat = httpx.post(f"{base_url}/v1/chat/completions", headers={"x-api-key": KEY}, timeout=60,
                      json={"model": "tiny", "max_tokens": 2, "messages": ASK})
    assert chat.status_code == 401  # the OpenAI routes take the key as a bearer token only


@pytest.mark.parametrize("pair", MODULE_PAIRS, ids=[pair.id for pair in MODULE_PAIRS])
def test_vllm_pair(base_url: str, pair: Pair) -> None:
    failures = run_pair(base_url, pair)
    assert not failures, "\n".join(failures)
