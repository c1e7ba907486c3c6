"""The Anthropic Messages API's conversions, without a server: requests into the chat path's
shape (system prompt, tool_use and tool_result blocks, tool_choice, sampling fields), chat
responses back into messages, and the chat event stream into Anthropic's events (thinking, text
held while a tool call is open, stop reasons, a failure mid-stream)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from vllm_actors.server.anthropic_convert import chat_request, message_body
from vllm_actors.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from vllm_actors.server.anthropic_stream import anthropic_events
from vllm_actors.server.errors import OpenAIError

WEATHER = {"name": "get_weather", "description": "The weather", "input_schema": {
    "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**fields: Any) -> MessagesRequest:
    body = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.convert(body, MessagesRequest)


def test_system_blocks_and_inline_system_messages_lead_as_one_message() -> None:
    chat = chat_request(request(
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc=1;"}, {"type": "text", "text": "Be "},
                {"type": "text", "text": "brief."}],
        messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": " Really."},
                  {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Be brief. Really."), ("user", "hi"), ("assistant", "ok")]


def test_tool_use_and_tool_result_blocks_become_tool_calls_and_tool_messages() -> None:
    chat = chat_request(request(tools=[WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Look it up.", "signature": "s"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"},
                                                                       {"type": "text", "text": "20 C"}]},
            {"type": "text", "text": "And tomorrow?"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "Rain"}]}]))
    roles = [(m.role, m.content, m.tool_call_id) for m in chat.messages]
    assert roles == [("user", "Weather in Paris?", None), ("assistant", "Looking.", None),
                     ("tool", "Sunny\n20 C", "toolu_1"), ("user", "And tomorrow?", None), ("tool", "Rain", "toolu_2")]
    assert chat.messages[1].tool_calls == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert chat.tool_choice == "auto"  # tools without a choice: vLLM's default
    assert chat.tools == [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("choice,expected", [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice_maps_to_the_chat_apis(choice: dict[str, Any], expected: Any) -> None:
    assert chat_request(request(tools=[WEATHER], tool_choice=choice)).tool_choice == expected


def test_sampling_fields_stream_options_and_count_tokens_requests() -> None:
    chat = chat_request(request(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, stop_sequences=["END"],
                                stream=True, output_config={"format": {"type": "json_schema",
                                                                       "schema": {"type": "object"}}}))
    assert (chat.max_tokens, chat.max_completion_tokens, chat.temperature, chat.top_p, chat.top_k, chat.stop) == (
        7, 7, 0.5, 0.9, 3, ["END"])
    assert chat.stream and chat.stream_options is not None and chat.stream_options.continuous_usage_stats
    assert chat.response_format is not None and chat.response_format.json_schema == {
        "name": "json_schema", "schema": {"type": "object"}}
    counted = chat_request(msgspec.convert({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                                           CountTokensRequest))
    assert counted.max_tokens is None and not counted.stream


@pytest.mark.parametrize("fields,message", [
    ({"max_tokens": 0}, "max_tokens must be positive"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.name is required when type is 'tool'"),
    ({"model": ""}, "Model is required")])
def test_vllms_checks_beyond_the_types(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(OpenAIError, match=message) as raised:
        request(**fields).check()
    assert raised.value.status == 400


def chat_response(message: dict[str, Any], finish_reason: str, stop_reason: Any = None) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "model": "tiny", "choices": [{
        "index": 0, "message": message, "finish_reason": finish_reason, "stop_reason": stop_reason}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13,
                      "prompt_tokens_details": {"cached_tokens": 5}}}


def test_message_bodies_blocks_stop_reasons_and_usage() -> None:
    call = {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"a": 1}'}}
    body = message_body(chat_response({"content": "Hi", "reasoning": "Hmm", "tool_calls": [call]}, "tool_calls"),
                        None)
    assert [block["type"] for block in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2] == {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "get_weather",
                                  "input": {"a": 1}}
    assert (body["stop_reason"], body["stop_sequence"]) == ("tool_use", None)
    assert body["usage"] == {"input_tokens": 4, "output_tokens": 4, "cache_read_input_tokens": 5}
    named = message_body(chat_response({"content": "", "tool_calls": [call]}, "stop"), None)
    assert named["stop_reason"] == "tool_use"  # a forced call ends "stop" in the chat API
    cut = message_body(chat_response({"content": None, "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": "{"}}]}, "length"), None)
    assert cut["content"] == [{"type": "text", "text": ""}] and cut["stop_reason"] == "max_tokens"
    stopped = message_body(chat_response({"content": "a"}, "stop", "END"), ["END"])
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    assert message_body(chat_response({"content": "a"}, "stop", 7), ["END"])["stop_reason"] == "end_turn"


# --------------------------------------------------------------------------- the stream
def chunk(delta: dict[str, Any] | None = None, finish_reason: str | None = None, stop_reason: Any = None,
          usage: dict[str, Any] | None = None) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                         "stop_reason": stop_reason}]
    return b"data: " + json.dumps({"id": "chatcmpl-1", "model": "tiny", "choices": choices,
                                   "usage": usage}).encode() + b"\n\n"


def events_of(chunks: list[bytes], stop_sequences: list[str] | None = None) -> list[dict[str, Any]]:
    async def source() -> AsyncIterator[bytes]:
        for piece in chunks:
            yield piece

    async def collect() -> list[bytes]:
        return [piece async for piece in anthropic_events(source(), stop_sequences)]

    events = []
    for frame in b"".join(asyncio.run(collect())).split(b"\n\n"):
        if frame:
            name, data = frame.split(b"\n")
            event = json.loads(data.removeprefix(b"data: "))
            assert name == b"event: " + event["type"].encode()
            events.append(event)
    return events


USAGE = {"prompt_tokens": 9, "completion_tokens": 0, "total_tokens": 9}


def test_stream_blocks_open_fill_and_close_in_order() -> None:
    call = {"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    events = events_of([
        chunk({"role": "assistant", "content": ""}, usage=USAGE),
        chunk({"reasoning": "Let me"}), chunk({"reasoning": " think."}),
        chunk({"content": "Sure."}),
        chunk({"tool_calls": [call]}), chunk({"content": " (held)"}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}),
        chunk({}, finish_reason="tool_calls"),
        chunk(usage={"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}), b"data: [DONE]\n\n"])
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["usage"] == {"input_tokens": 9, "output_tokens": 0}
    assert events[0]["message"]["role"] == "assistant" and events[0]["message"]["content"] == []
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [
        (0, "thinking"), (1, "text"), (2, "tool_use"), (3, "text")]
    assert starts[2]["content_block"] == {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "f", "input": {}}
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert deltas[2]["type"] == "signature_delta"  # a thinking block ends with its signature
    assert "".join(d.get("partial_json", "") for d in deltas) == '{"a": 1}'
    assert [d["text"] for d in deltas if d["type"] == "text_delta"] == ["Sure.", " (held)"]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 9, "output_tokens": 6}


def test_stream_stop_sequence_and_an_empty_reply() -> None:
    events = events_of([chunk({"role": "assistant", "content": ""}, usage=USAGE),
                        chunk({"content": "ab"}, finish_reason="stop", stop_reason="END"),
                        chunk(usage=USAGE), b"data: [DONE]\n\n"], ["END"])
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    empty = events_of([chunk({"role": "assistant", "content": ""}, usage=USAGE), chunk({}, finish_reason="length"),
                       chunk(usage=USAGE), b"data: [DONE]\n\n"])
    assert [e["type"] for e in empty] == ["message_start", "message_delta", "message_stop"]
    assert empty[1]["delta"]["stop_reason"] == "max_tokens"


def test_a_failure_mid_stream_is_an_error_event_that_ends_it() -> None:
    error = b'data: {"error": {"message": "The engine failed: gone", "type": "ServiceUnavailableError", "code": 503}}'
    events = events_of([chunk({"role": "assistant", "content": ""}, usage=USAGE), chunk({"content": "a"}),
                        error + b"\n\n", b"data: [DONE]\n\n"])
    assert events[-1] == {"type": "error", "error": {"type": "ServiceUnavailableError",
                                                     "message": "The engine failed: gone"}}
    assert "message_stop" not in [e["type"] for e in events]
