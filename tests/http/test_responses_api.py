"""The Responses API through a real server on the tiny model, with the official ``openai`` client:
``responses.create`` streamed and not (greedy text identical to the chat endpoint's for the same
conversation), instructions and input items, ``previous_response_id``, ``store``, retrieve and
cancel, a background stream replayed after a sequence number, a function tool call (named and
required, streamed with its argument events, then its output sent back), ``text.format``
json_schema (and ``responses.parse``), the error cases, and the pinned request/response pairs
from vLLM 0.26's tests (``vllm_pairs/responses.json``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.support.server_helpers import served_url
from tests.support.tool_calls import TOOL_ID
from tests.support.vllm_pairs import Pair, load_pairs, run_pair

MODULE_PAIRS = load_pairs(module="test_responses_api")  # vllm_pairs/responses.json, on this module's server
FORECAST = {"type": "function", "name": "forecast", "description": "The weather forecast", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
# vLLM's event-stack check (tests/entrypoints/openai/responses/test_function_call.py): each done closes
# the last thing opened
PAIRS_OF_EVENT_TYPES = {
    "response.completed": "response.created",
    "response.output_item.done": "response.output_item.added",
    "response.output_text.done": "response.output_text.delta",
    "response.content_part.done": "response.content_part.added",
    "response.reasoning_text.done": "response.reasoning_text.delta",
    "response.reasoning_part.done": "response.reasoning_part.added",
    "response.function_call_arguments.done": "response.function_call_arguments.delta",
}


@pytest.fixture(scope="module")
def base_url(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with served_url(tiny_qwen3, tmp_path_factory.mktemp("responses_http"), "--served-model-name", "tiny",
                    "--max-model-len", "512", "--num-gpu-blocks-override", "256") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int) -> str:
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,  # type: ignore[arg-type]  # plain dicts
                                           temperature=0)
    return reply.choices[0].message.content or ""


def check_event_stack(events: list[Any]) -> None:
    stack: list[str] = []
    for event in events:
        kind = event.type
        if kind == "response.created":
            stack.append(kind)
        elif kind == "response.completed":
            assert stack.pop() == PAIRS_OF_EVENT_TYPES[kind]
        elif kind.endswith("added"):
            stack.append(kind)
        elif kind.endswith("delta"):
            if stack[-1] != kind:
                stack.append(kind)
        elif kind.endswith("done"):
            assert stack.pop() == PAIRS_OF_EVENT_TYPES[kind], (kind, stack)
    assert not stack
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_create_is_the_chat_answer_as_output_items_and_is_stored(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Hello there", max_output_tokens=12, temperature=0)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status in ("completed", "incomplete")
    assert response.output_text == chat_text(client, [{"role": "user", "content": "Hello there"}], 12)
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.usage is not None and response.usage.output_tokens <= 12
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.max_output_tokens == 12 and response.temperature == 0
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()


def test_instructions_and_input_items_make_the_chat_conversation(client: openai.OpenAI) -> None:
    response = client.responses.create(
        model="tiny", instructions="Be brief.", max_output_tokens=10, temperature=0,
        input=[{"role": "user", "content": "Hi"},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Again"}]}])
    expected = chat_text(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again"}],
                         10)
    assert response.output_text == expected


def test_a_cut_off_response_is_incomplete(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Count", max_output_tokens=1, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}})
    assert response.status == "incomplete"
    assert response.incomplete_details is not None and response.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_are_well_formed_and_end_with_the_response(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="tiny", input="Hello there", max_output_tokens=12, temperature=0,
                                          stream=True))
    check_event_stack(events)
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    completed = events[-1].response
    assert text == completed.output_text == chat_text(client, [{"role": "user", "content": "Hello there"}], 12)
    assert events[0].response.status == "in_progress" and completed.id == events[0].response.id
    assert completed.usage is not None and completed.usage.output_tokens > 0
    assert client.responses.retrieve(completed.id).output_text == text


def test_a_background_stream_is_replayed_after_a_sequence_number(client: openai.OpenAI) -> None:
    """vLLM's test_streaming with background=True: the events after ``starting_after``, equal to the
    first stream's."""
    events = list(client.responses.create(model="tiny", input="Hello there", max_output_tokens=8, temperature=0,
                                          stream=True, background=True))
    check_event_stack(events)
    response_id = events[0].response.id
    starting_after = 3
    with client.responses.retrieve(response_id, stream=True, starting_after=starting_after) as replay:
        assert [event.model_dump() for event in replay] == [event.model_dump() for event in events[4:]]
    assert client.responses.retrieve(response_id).model_dump() == events[-1].response.model_dump()


def test_previous_response_id_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = client.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=8, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=8, temperature=0)
    assert second.previous_response_id == first.id
    expected = chat_text(client, [{"role": "user", "content": "My name is Ada."},
                                  {"role": "assistant", "content": first.output_text},
                                  {"role": "user", "content": "What is my name?"}], 8)
    assert second.output_text == expected


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{response.id}' not found."):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="Hi", previous_response_id=response.id, max_output_tokens=2)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "forecast"}, "required"])
def test_a_function_call_and_its_output_sent_back(client: openai.OpenAI, tool_choice: Any) -> None:
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    response = client.responses.create(model="tiny", input=ask, tools=[FORECAST], tool_choice=tool_choice,  # type: ignore[arg-type]  # plain dicts
                                       max_output_tokens=200, temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "forecast" and TOOL_ID.match(call.call_id) for call in calls)
    jsonschema.validate(json.loads(calls[0].arguments), FORECAST["parameters"])
    assert response.status == "completed"
    follow = client.responses.create(
        model="tiny", max_output_tokens=4, tools=[FORECAST], previous_response_id=response.id,  # type: ignore[arg-type]
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete")


def test_a_streamed_function_call_sends_its_argument_events(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model="tiny", input="Weather in Oslo?", tools=[FORECAST],  # type: ignore[arg-type]
                                          tool_choice={"type": "function", "name": "forecast"},
                                          max_output_tokens=200, temperature=0, stream=True))
    check_event_stack(events)
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    item_done = next(e for e in events if e.type == "response.output_item.done" and e.item.type == "function_call")
    assert added.item.name == done.name == "forecast" and done.arguments == arguments == item_done.item.arguments
    jsonschema.validate(json.loads(arguments), FORECAST["parameters"])
    final = events[-1].response.output
    assert [item.type for item in final] == ["function_call"] and final[0].arguments == arguments


def test_text_format_json_schema_holds_the_output(client: openai.OpenAI) -> None:
    for seed in range(2):
        response = client.responses.create(
            model="tiny", input="Answer in JSON.", max_output_tokens=60, extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}})
        jsonschema.validate(json.loads(response.output_text), SCHEMA)

    class Event(BaseModel):
        ok: bool
        day: Literal["Monday", "Friday"]

    parsed = client.responses.parse(model="tiny", input="An event.", text_format=Event, max_output_tokens=80)
    assert isinstance(parsed.output_parsed, Event)


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "input": "x"}, 404, "model"),
    ({"input": []}, 400, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),
    ({"input": "x", "tools": [{"type": "web_search_preview"}]}, 400, "tools"),
    ({"input": "x", "tools": [FORECAST], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"input": "x", "background": True, "store": False}, 400, "background"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "response_id"),
    ({"input": 5}, 400, "input"),
])
def test_bad_requests_are_refused_naming_the_field(base_url: str, body: dict[str, Any], status: int,
                                                   param: str) -> None:
    reply = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


def test_retrieve_and_cancel_of_unknown_or_finished_responses(client: openai.OpenAI, base_url: str) -> None:
    unknown = f"{base_url}/v1/responses/resp_nope"
    for reply in (httpx.get(unknown), httpx.post(f"{unknown}/cancel")):
        assert reply.status_code == 404
        assert reply.json()["error"]["message"] == "Response with id 'resp_nope' not found."
    done = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    reply = httpx.post(f"{base_url}/v1/responses/{done.id}/cancel")
    assert reply.status_code == 400 and reply.json()["error"]["message"] == "Cannot cancel a synchronous response."


# --------------------------------------------------------------------------- vLLM's pairs
@pytest.mark.parametrize("pair", MODULE_PAIRS, ids=[pair.id for pair in MODULE_PAIRS])
def test_vllm_pairs(base_url: str, pair: Pair) -> None:
    failures = run_pair(base_url, pair)
    assert not failures, "\n".join(failures)
