"""Tools on ``/v1/chat/completions``, as vLLM serves them.

``plan_tools`` checks ``tools`` and ``tool_choice`` (vLLM's ``check_tool_usage``: a 400 naming the
field for an empty list, a choice without tools, an unknown value or function) and says what the
request does: ``"none"`` leaves the output as content (the tools still reach the chat template);
a named function and ``"required"`` constrain the output through structured outputs to the JSON
schema vLLM builds (the function's parameters; an array of ``{"name", "parameters"}``); ``"auto"``
(the default with tools) parses the model's own tool-call markup with the server's
``--tool-call-parser`` and needs ``--enable-auto-tool-choice``, as vLLM. ``ToolPlan.parser`` reads
one choice's output (``tool_parser``); with ``parallel_tool_calls`` false only the first call is
kept (vLLM's rule).

``history_tool_calls`` turns an assistant message's ``tool_calls`` into what chat templates read
(arguments as an object, as vLLM gives them to the template).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from vllm_actors.protocol.sampling import StructuredOutputs
from vllm_actors.server.errors import bad_request
from vllm_actors.server.forced_tool_calls import NamedCallParser, RequiredCallsParser
from vllm_actors.server.protocol import (
    ChatCompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from vllm_actors.server.tool_parser import CallDelta, HermesToolParser, ToolCallText, ToolParser

_AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
_NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


@dataclass(frozen=True)
class ToolPlan:
    mode: Literal["auto", "required", "named"]
    name: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls

    def parser(self) -> ToolParser:
        if self.mode == "named":
            assert self.name is not None
            return NamedCallParser(self.name)
        if self.mode == "required":
            return RequiredCallsParser()
        return HermesToolParser()

    def keep(self, deltas: list[CallDelta]) -> list[CallDelta]:
        return deltas if self.parallel else [d for d in deltas if d.index == 0]

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """vLLM's: "tool_calls" once auto calls a tool, or a required call ends normally."""
        if called and (self.mode == "auto" or (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason


@dataclass(frozen=True)
class ToolRequest:
    plan: ToolPlan | None  # None: no parsing (no tools, or tool_choice "none")
    template_tools: list[dict[str, Any]] | None  # what the chat template sees as ``tools``
    constraint: StructuredOutputs | None  # for a named function and "required"


def plan_tools(body: ChatCompletionRequest, *, auto_enabled: bool) -> ToolRequest:
    """``tools`` and ``tool_choice`` checked (400s naming them) and what they ask for."""
    if body.tools is not None and not body.tools:
        raise bad_request("tools: must not be an empty array; either provide at least one tool or omit the field "
                          "entirely", "tools")
    tools = _decode_tools(body.tools or [])
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    template_tools = [dict(tool) for tool in body.tools or []] if tools else None
    if choice == "none":
        return ToolRequest(None, template_tools, None)
    if not tools:
        raise bad_request("tool_choice: when using `tool_choice`, `tools` must be set", "tool_choice")
    parallel = body.parallel_tool_calls is not False
    if isinstance(choice, dict):
        name = _named(choice, tools)
        function = next(tool.function for tool in tools if tool.function.name == name)
        _no_other_constraint(body)
        schema = function.parameters or {"type": "object", "properties": {}}
        return ToolRequest(ToolPlan("named", name, parallel), template_tools, _json(schema))
    if choice == "required":
        _no_other_constraint(body)
        return ToolRequest(ToolPlan("required", None, parallel), template_tools, _json(required_schema(tools)))
    if choice == "auto":
        if not auto_enabled:
            raise bad_request(f"tool_choice: {_AUTO_NEEDS_FLAGS}", "tool_choice")
        return ToolRequest(ToolPlan("auto", None, parallel), template_tools, None)
    raise bad_request(f"tool_choice: invalid value {choice!r}; only named tools, \"none\", \"auto\" or \"required\" "
                      "are supported"[:500], "tool_choice")


def required_schema(tools: list[ToolParam]) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": at least one ``{"name", "parameters"}`` of a tool,
    the tools' ``$defs`` gathered at the top."""
    defs: dict[str, Any] = {}
    variants = []
    for tool in tools:
        parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
        for name, definition in parameters.pop("$defs", {}).items():
            if name in defs and defs[name] != definition:
                raise bad_request(f"tools: the definition {name!r} has several schemas, which is not supported",
                                  "tools")
            defs[name] = definition
        variants.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if defs:
        schema["$defs"] = defs
    return schema


def history_tool_calls(tool_calls: Any, position: int) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the chat template: arguments as an object."""
    field = f"messages[{position}].tool_calls"
    if not isinstance(tool_calls, list):
        raise bad_request(f"{field}: must be a list", "messages")
    calls = []
    for index, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad_request(f"{field}[{index}]: must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                              "\"arguments\": ...}}", "messages")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except (ValueError, RecursionError):
                raise bad_request(f"{field}[{index}].function.arguments: not valid JSON", "messages") from None
        calls.append({**call, "function": {**function, "arguments": arguments if arguments is not None else {}}})
    return calls


def tool_calls_body(calls: list[ToolCallText]) -> list[ToolCall]:
    return [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments)) for call in calls]


def delta_tool_calls(deltas: list[CallDelta]) -> list[DeltaToolCall]:
    """Parser deltas as OpenAI streams them, pieces of one call in a row merged."""
    out: list[DeltaToolCall] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and last.index == delta.index and delta.id is None and last.function is not None:
            last.function.arguments = (last.function.arguments or "") + delta.arguments
            continue
        if delta.id is not None:
            out.append(DeltaToolCall(index=delta.index, id=delta.id, type="function",
                                     function=DeltaFunctionCall(name=delta.name, arguments=delta.arguments)))
        else:
            out.append(DeltaToolCall(index=delta.index, function=DeltaFunctionCall(arguments=delta.arguments)))
    return out


def _decode_tools(raw: list[Any]) -> list[ToolParam]:
    tools = []
    for index, tool in enumerate(raw):
        try:
            tools.append(msgspec.convert(tool, ToolParam))
        except msgspec.ValidationError as error:
            raise bad_request(f"tools[{index}]: {error}"[:500], "tools") from None
    return tools


def _named(choice: dict[str, Any], tools: list[ToolParam]) -> str:
    function = choice.get("function")
    if choice.get("type", "function") != "function":
        raise bad_request(f"tool_choice: type must be \"function\", got {choice.get('type')!r}; {_NAMED_USAGE}"[:500],
                          "tool_choice")
    if not isinstance(function, dict):
        raise bad_request(f"tool_choice.function: invalid value {function!r}; {_NAMED_USAGE}"[:500], "tool_choice")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"tool_choice.function.name: invalid value {name!r}; {_NAMED_USAGE}"[:500], "tool_choice")
    if all(tool.function.name != name for tool in tools):
        raise bad_request(f"tool_choice: the tool specified ({name!r}) does not match any of the specified `tools`"
                          [:500], "tool_choice")
    return name


def _no_other_constraint(body: ChatCompletionRequest) -> None:
    if body.structured_outputs is not None or (body.response_format is not None
                                               and body.response_format.type != "text"):
        raise bad_request("tool_choice: you can only either use constraints for structured outputs or tools, not both",
                          "tool_choice")


def _json(schema: dict[str, Any]) -> StructuredOutputs:
    return StructuredOutputs(json=json.dumps(schema, ensure_ascii=False))
