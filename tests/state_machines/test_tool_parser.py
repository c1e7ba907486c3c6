"""The tool-call parsers (server/tool_parser.py) as pure state machines, fed the
same outputs whole, split at every position, and one character at a time: the same content and
calls every way, markup never in the content, a call's first delta carrying its id and name. And
tools.py's schemas (vLLM's) and history conversion."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import msgspec
import pytest

from vllm_actors.server.errors import OpenAIError
from vllm_actors.server.forced_tool_calls import NamedCallParser, RequiredCallsParser
from vllm_actors.server.tool_parser import (
    CallDelta,
    HermesToolParser,
    ParsedDelta,
    ToolCallText,
    ToolParser,
    merge_calls,
    new_tool_call_id,
    parse_all,
)
from vllm_actors.server.tools import ToolParam, history_tool_calls, required_schema

WEATHER = '{"name": "get_weather", "arguments": {"city": "Pa\\"ris </tool_call>", "days": [1, {"a": "}"}]}}'
TWO_CALLS = (f"Let me check. <tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
             '{"arguments": {"x": 1}, "name": "b"}\n</tool_call>\n\nDone.')


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def run(parser: ToolParser, pieces: list[str]) -> tuple[ParsedDelta, list[ParsedDelta]]:
    deltas = [parser.feed(piece) for piece in pieces]
    deltas.append(parser.finish())
    total = ParsedDelta()
    for delta in deltas:
        total.extend(delta)
    return total, deltas


def splits(text: str) -> list[list[str]]:
    """The text whole, cut once at every position, and one character at a time."""
    return [[text], *([text[:i], text[i:]] for i in range(1, len(text))), list(text)]


HERMES_CASES: list[tuple[str, str, list[tuple[str, str]]]] = [
    (TWO_CALLS, "Let me check. Done.",
     [("get_weather", '{"city": "Pa\\"ris </tool_call>", "days": [1, {"a": "}"}]}'), ("b", '{"x": 1}')]),
    ("The capital is Paris.", "The capital is Paris.", []),
    ("  spaced out  \n", "  spaced out  \n", []),
    (f"<tool_call>{WEATHER}</tool_call>", "", [("get_weather", json.loads(WEATHER)["arguments"])]),
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ('<tool_call>{"name": "x", "arguments": {"k": "v"}}', "", [("x", '{"k": "v"}')]),  # cut off: still a call
    ('<tool_call>{"arguments": {"k": 1}, "name": "y"}', "", [("y", '{"k": 1}')]),
    ("x < y and <tool", "x < y and <tool", []),  # a partial tag at the end is content after all
    ("<tool_call>{}</tool_call>", "<tool_call>{}</tool_call>", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_parser_gives_the_same_calls_and_content_however_the_text_is_split(
        text: str, content: str, calls: list[tuple[str, str | dict[str, object]]]) -> None:
    expected = [(name, args if isinstance(args, str) else json.dumps(args)) for name, args in calls]
    for pieces in splits(text):
        total, deltas = run(HermesToolParser(ids()), pieces)
        assert total.content == content, pieces
        merged = merge_calls(total.calls)
        assert [(c.name, c.arguments) for c in merged] == expected, pieces
        assert [c.id for c in merged] == [f"id{i}" for i in range(len(expected))]
        if expected and "<tool_call>" not in content:
            assert all("<tool" not in d.content and "</" not in d.content for d in deltas), pieces
        for index in range(len(expected)):  # the first delta of a call names it; the rest are arguments
            mine = [d for d in total.calls if d.index == index]
            assert mine[0].id is not None and mine[0].name is not None
            assert all(d.id is None and d.name is None for d in mine[1:])


def test_hermes_arguments_stream_as_they_are_generated() -> None:
    parser = HermesToolParser(ids())
    assert parser.feed("Sure.\n<tool_call>\n{\"name\": \"get_").calls == []
    head = parser.feed('weather", "arguments": {"ci')
    assert head.calls == [CallDelta(0, "", "id0", "get_weather"), CallDelta(0, '{"ci')]
    assert parser.feed('ty": "Paris"').calls == [CallDelta(0, 'ty": "Paris"')]
    assert parser.feed("}}\n</tool_").calls == [CallDelta(0, "}")]
    last = parser.feed("call>")
    assert last.calls == [] and last.content == ""
    assert parser.finish() == ParsedDelta()
    assert parse_all(HermesToolParser(ids()), 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": '
                     '{"city": "Paris"}}\n</tool_call>') == ("Sure.", [ToolCallText("id0", "get_weather",
                                                                                    '{"city": "Paris"}')])


def test_tool_call_ids_are_vllms() -> None:
    first, second = new_tool_call_id(), new_tool_call_id()
    assert first != second and first.startswith("chatcmpl-tool-") and len(first) == len("chatcmpl-tool-") + 32
    int(first.removeprefix("chatcmpl-tool-"), 16)


def test_named_parser_makes_the_whole_output_the_arguments() -> None:
    text = '{"city": "Paris", "days": 3}'
    for pieces in splits(text):
        total, _ = run(NamedCallParser("get_weather", ids()), pieces)
        assert total.content == "" and merge_calls(total.calls) == [ToolCallText("id0", "get_weather", text)]
        assert total.calls[0].id == "id0" and all(d.id is None for d in total.calls[1:])
    empty, _ = run(NamedCallParser("f", ids()), [""])
    assert merge_calls(empty.calls) == [ToolCallText("id0", "f", "")]


def test_required_parser_reads_vllms_array_of_calls() -> None:
    text = ('[{"name": "get_weather", "parameters": {"city": "P]a{r\\"is"}}, {"name": "now", "parameters": {}},'
            ' {"parameters": {"x": [1]}, "name": "late"}]')
    for pieces in splits(text):
        total, _ = run(RequiredCallsParser(ids()), pieces)
        assert total.content == ""
        assert merge_calls(total.calls) == [ToolCallText("id0", "get_weather", '{"city": "P]a{r\\"is"}'),
                                            ToolCallText("id1", "now", "{}"), ToolCallText("id2", "late", '{"x": [1]}')]
        assert all((d.id is None) == (d.name is None) for d in total.calls)
    parser = RequiredCallsParser(ids())  # the name as soon as it is read, then the parameters as generated
    assert parser.feed('[{"name": "get_weather", "parameters": {"ci').calls == [
        CallDelta(0, "", "id0", "get_weather"), CallDelta(0, '{"ci')]
    assert parser.feed('ty": "Oslo"}}]').calls == [CallDelta(0, 'ty": "Oslo"}')]
    assert parse_all(RequiredCallsParser(ids()), "no calls here") == ("no calls here", [])


def test_required_schema_is_vllms() -> None:
    tools = msgspec.convert([
        {"type": "function", "function": {"name": "a", "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "b"}}], list[ToolParam])
    assert required_schema(tools) == {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": ["a"]},
                            "parameters": {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}}},
             "required": ["name", "parameters"]},
            {"properties": {"name": {"type": "string", "enum": ["b"]},
                            "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]},
        "$defs": {"P": {"type": "string"}},
    }


def test_history_tool_calls_give_the_template_arguments_as_an_object() -> None:
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]
    assert history_tool_calls(calls, 1) == [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}},
        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {}}}]
    for bad in ([{"function": {"name": "f", "arguments": "{oops"}}], [{"type": "function"}], "nope"):
        with pytest.raises(OpenAIError) as error:
            history_tool_calls(bad, 2)
        assert error.value.status == 400 and "messages[2].tool_calls" in str(error.value)
