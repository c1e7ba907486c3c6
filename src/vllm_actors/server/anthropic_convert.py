"""Anthropic Messages requests as chat requests, and chat responses back as Anthropic messages,
following vLLM 0.26's ``AnthropicServingMessages``: the chat path does the generation.

Requests: the system prompt (a string or text blocks) and any ``system`` message of the
conversation become one leading system message (vLLM's behaviour without --chat-template);
``tool_use`` blocks become the assistant's ``tool_calls``; a user's ``tool_result`` becomes a
``tool`` message placed before what else that user message says; ``tool_choice`` ``any`` is
``required`` and ``tool`` a named function; tools default to ``auto``. Responses: thinking (once
the chat path returns ``reasoning``), text and ``tool_use`` blocks, in that order; an empty reply
is one empty text block. Two stop reasons follow Anthropic's API where vLLM 0.26 reports
``end_turn``: a stop string from ``stop_sequences`` is ``"stop_sequence"`` (with that string in
``stop_sequence``), and a reply holding a forced tool call is ``"tool_use"``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import msgspec

from vllm_actors.server.anthropic_protocol import (
    STOP_REASONS,
    AnthropicMessage,
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
    StopReason,
    usage_body,
)
from vllm_actors.server.errors import bad_request
from vllm_actors.server.protocol import ChatCompletionRequest

_BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request header: kept out (it defeats prefix caching)


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that serves (or, for count_tokens, renders) ``body``."""
    chat: dict[str, Any] = {"model": body.model, "messages": chat_messages(body),
                            "chat_template_kwargs": body.chat_template_kwargs}
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, max_completion_tokens=body.max_tokens, stop=body.stop_sequences,
                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    kv_transfer_params=body.kv_transfer_params)
        if body.stream:  # usage on every chunk: message_start's input tokens, message_delta's totals
            chat.update(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
        config = body.output_config
        if config is not None and config.format is not None and config.format.json_schema:
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "json_schema", "schema": config.format.json_schema}}
        if config is not None and config.effort is not None:
            chat["reasoning_effort"] = config.effort
    if body.tool_choice is not None:
        kind = body.tool_choice.type
        chat["tool_choice"] = ({"type": "function", "function": {"name": body.tool_choice.name}} if kind == "tool"
                               else {"any": "required"}.get(kind, kind))
    if body.tools is not None:
        chat["tools"] = [{"type": "function", "function": _function(tool.name, tool.description, tool.input_schema,
                                                                    tool.strict)} for tool in body.tools]
        chat.setdefault("tool_choice", "auto")
    try:
        return msgspec.convert({k: v for k, v in chat.items() if v is not None}, ChatCompletionRequest)
    except msgspec.ValidationError as error:
        raise bad_request(f"invalid request: {error}") from None


def _function(name: str, description: str | None, schema: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    function = {"name": name, "description": description, "parameters": {"type": "object", **schema},
                "strict": strict}
    return {key: value for key, value in function.items() if value is not None}


def chat_messages(body: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation in the chat API's shape (see the module's docstring)."""
    system = [_system_text(body.system)] + [_system_text(m.content) for m in body.messages if m.role == "system"]
    joined = "".join(text for text in system if text)
    messages: list[dict[str, Any]] = [{"role": "system", "content": joined}] if joined else []
    for message in body.messages:
        if message.role == "system":
            continue
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        else:
            entry = _blocks_message(message, messages)
            if entry is not None:
                messages.append(entry)
    return messages


def _system_text(content: str | list[ContentBlock] | None) -> str | None:
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    texts = [block.text for block in content or () if block.type == "text" and block.text
             and not block.text.startswith(_BILLING_HEADER)]
    return "".join(texts) or None


def _blocks_message(message: AnthropicMessage, out: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A message of content blocks as one chat message (None: a user message that held only tool
    results, which went to ``out`` as tool messages)."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    assert isinstance(message.content, list)
    for block in message.content:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": block.name or "", "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result" and message.role == "user":
            out.extend(_tool_result_messages(block))
        elif block.type == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.content or ''}"})
        # redacted_thinking (opaque) and tool_reference (read inside tool results) add nothing here
    entry: dict[str, Any] = {"role": message.role}
    if reasoning:
        entry["reasoning"] = "".join(reasoning)  # read once the chat messages carry reasoning
    if calls:
        entry["tool_calls"] = calls
    if parts:
        entry["content"] = parts[0]["text"] if len(parts) == 1 and parts[0]["type"] == "text" else parts
    if message.role == "user" and "content" not in entry:
        return None
    return entry


def _tool_result_messages(block: ContentBlock) -> list[dict[str, Any]]:
    """A user's tool result: a ``tool`` message (its text items joined by newlines), then its
    images as a user message (a text model refuses them, as for any image)."""
    text, images = "", []
    if isinstance(block.content, str):
        text = block.content
    elif isinstance(block.content, list):
        items = [item for item in block.content if isinstance(item, dict)]
        text = "\n".join(str(item.get("text", "")) for item in items if item.get("type") == "text")
        images = [_image_url(item.get("source") or {}) for item in items if item.get("type") == "image"]
    messages: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text}]
    if images:
        messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}
                                                     for url in images]})
    return messages


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


# --------------------------------------------------------------------------- responses
def stop_of(finish_reason: str | None, matched: object, stop_sequences: list[str] | None,
            called: bool = False) -> tuple[StopReason | None, str | None]:
    """(stop_reason, stop_sequence) of a choice that ended with ``finish_reason``, ``matched``
    being the chat path's ``stop_reason`` (the stop string that ended it, if one did) and
    ``called`` whether the reply holds a tool call (a forced call ends "stop" in the chat API;
    Anthropic's clients run tools on ``tool_use``)."""
    if finish_reason == "stop" and called:
        return "tool_use", None
    if finish_reason == "stop" and isinstance(matched, str) and matched in (stop_sequences or ()):
        return "stop_sequence", matched
    return (STOP_REASONS.get(finish_reason) if finish_reason else None), None


def tool_input(arguments: str) -> dict[str, Any] | None:
    """A call's arguments as ``tool_use.input``; None when they are no JSON object (a call cut
    off by max_tokens): such a call is left out, as the chat path leaves it out of tool_calls."""
    try:
        value = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def message_body(chat: dict[str, Any], stop_sequences: list[str] | None) -> dict[str, Any]:
    """A chat completion (its JSON) as an Anthropic message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": uuid.uuid4().hex})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        arguments = tool_input(call["function"]["arguments"])
        if arguments is not None:
            content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                            "input": arguments})
    called = any(block["type"] == "tool_use" for block in content)
    stop_reason, stop_sequence = stop_of(choice.get("finish_reason"), choice.get("stop_reason"), stop_sequences,
                                         called)
    return {"id": chat["id"], "type": "message", "role": "assistant",
            "content": content or [{"type": "text", "text": ""}],  # clients read content[0]
            "model": chat["model"], "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": usage_body(chat.get("usage"))}
