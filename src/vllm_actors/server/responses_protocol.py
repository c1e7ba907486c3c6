"""The Responses API's request (vLLM 0.26's ``ResponsesRequest`` fields) and its conversion to a
chat completion request: input items to chat messages, flat function tools to chat tools,
``tool_choice`` and ``text.format`` to their chat spellings. A response is a chat completion with
another input and output shape, so everything after the conversion is the chat path's."""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_actors.server.errors import bad_request
from vllm_actors.server.protocol import ChatCompletionRequest

OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the one ``include`` value honoured
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] = []
    tool_choice: Any = "auto"
    parallel_tool_calls: bool | None = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    include: list[str] | None = None
    top_logprobs: int | None = 0
    metadata: dict[str, str] | None = None
    reasoning: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = "disabled"
    service_tier: str = "auto"
    max_tool_calls: int | None = None
    prompt: Any = None
    # vLLM's extras
    request_id: str | None = None
    top_k: int | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None

    @property
    def output_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or [])


def check_request(body: ResponsesRequest) -> None:
    """vLLM's own refusals of a Responses request, with its wording."""
    if body.background and not body.store:
        raise bad_request("background can only be used when `store` is true", "background")
    if body.prompt is not None:
        raise bad_request("prompt template is not supported", "prompt")
    if body.cache_salt is not None and not body.cache_salt:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise bad_request(f"max_output_tokens: must be at least 1, got {body.max_output_tokens}", "max_output_tokens")
    if body.truncation not in (None, "disabled", "auto"):
        raise bad_request(f"truncation: must be \"auto\" or \"disabled\", got {body.truncation!r}"[:500], "truncation")


def input_messages(raw: str | list[Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as chat messages: a string is one user message; items are messages
    (text parts joined), ``function_call`` (consecutive ones merged into one assistant turn),
    ``function_call_output`` (a tool message) and ``reasoning`` (an assistant turn of that
    reasoning alone, which the chat template may show: vLLM's conversion)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    messages: list[dict[str, Any]] = []
    for position, item in enumerate(raw):
        where = f"input[{position}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be an object (a message or an item), got {item!r}"[:500], "input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _joined(output, f"{where}.output")
            messages.append({"role": "tool", "content": output, "tool_call_id": _text(item, "call_id", where)})
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": "", "reasoning": _reasoning(item, where)})
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output, reasoning)"[:500], "input")
    if not messages:
        raise bad_request("input: must hold at least one message", "input")
    return messages


def _reasoning(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text as vLLM reads it: its one summary part, else its one content part,
    else nothing; encrypted reasoning is refused (this server cannot decrypt it)."""
    if item.get("encrypted_content"):
        raise bad_request("Encrypted content is not supported.", "input")
    summary, content = item.get("summary") or [], item.get("content") or []
    parts = summary if len(summary) == 1 else content if len(content) == 1 else []
    for part in parts:
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}: a reasoning item's summary and content parts must hold a text"[:500], "input")
    return str(parts[0]["text"]) if parts else ""


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{where}.role: must be user, assistant, system or developer, got {role!r}"[:500], "input")
    content = item.get("content")
    text = content if isinstance(content, str) else _joined(content, f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": text}


def _joined(parts: Any, where: str) -> str:
    if not isinstance(parts, list):
        raise bad_request(f"{where}: must be a string or a list of text parts", "input")
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{index}]: content parts of type {kind!r} are not supported (text only)"[:500],
                              "input")
        texts.append(part["text"])
    return "\n".join(texts)


def _text(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: must be a string, got {value!r}"[:500], "input")
    return value


def chat_tools(tools: list[Any]) -> list[dict[str, Any]] | None:
    """Flat function tools (``{"type": "function", "name", "parameters", ...}``) as chat tools."""
    converted = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{index}]: tools of type {kind!r} are not supported (function tools only)"[:500],
                              "tools")
        converted.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    return converted or None


def chat_tool_choice(choice: Any, has_tools: bool, auto_enabled: bool) -> Any:
    """``tool_choice`` in the chat spelling. Without tools, or "auto" without the server's
    --enable-auto-tool-choice, the output is left as text (vLLM's Responses rule)."""
    if not has_tools or (choice == "auto" and not auto_enabled):
        return None if not has_tools else "none"
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request(f"tool_choice: must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", "
                              f"\"name\": ...}}, got {choice!r}"[:500], "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat ``response_format``."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise bad_request("text.format: must be an object", "text")
    kind = spec.get("type")
    if kind == "json_schema":
        if spec.get("schema") is None:
            raise bad_request("text.format: schema is required for type \"json_schema\"", "text")
        schema = {key: spec[key] for key in ("name", "schema", "strict", "description") if key in spec}
        return {"type": "json_schema", "json_schema": schema}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise bad_request(f"text.format: type must be \"text\", \"json_object\" or \"json_schema\", got {kind!r}"[:500],
                      "text")


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]], *, auto_tools: bool) -> ChatCompletionRequest:
    """The chat completion request a Responses request stands for (streamed with usage, so that
    the final event carries it)."""
    tools = chat_tools(body.tools)
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "top_k": body.top_k, "seed": body.seed, "repetition_penalty": body.repetition_penalty,
        "logit_bias": body.logit_bias, "skip_special_tokens": body.skip_special_tokens, "priority": body.priority,
        "cache_salt": body.cache_salt, "user": body.user, "tools": tools,
        "tool_choice": chat_tool_choice(body.tool_choice, tools is not None, auto_tools),
        "parallel_tool_calls": body.parallel_tool_calls, "response_format": response_format(body.text),
        "logprobs": body.output_logprobs, "top_logprobs": body.top_logprobs if body.output_logprobs else None,
        "stream": body.stream, "stream_options": {"include_usage": True} if body.stream else None,
    }
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        fields["reasoning_effort"] = effort
    try:
        return msgspec.convert(fields, ChatCompletionRequest)
    except msgspec.ValidationError as error:
        raise bad_request(f"invalid request: {error}"[:500]) from None
