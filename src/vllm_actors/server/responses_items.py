"""The Responses API's output: output items (message, function_call, reasoning) made from a chat
completion's message, usage, and the response object around them, in vLLM 0.26's shapes.

``output_items`` is the one place where a chat result becomes output items: a ``reasoning`` (or
``reasoning_content``) field on the chat message becomes a reasoning item before the message."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from vllm_actors.server.responses_protocol import ResponsesRequest

Item = dict[str, Any]


def new_id(prefix: str) -> str:
    """``<prefix>_<32 hex digits>``, as vLLM's ``resp_``, ``msg_``, ``fc_`` and ``rs_`` ids."""
    return f"{prefix}_{secrets.token_hex(16)}"


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def message_item(item_id: str, text: str | None, logprobs: list[dict[str, Any]] | None = None,
                 status: str = "completed") -> Item:
    """An assistant message; ``text`` None: no content part yet (an item just added)."""
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> Item:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def reasoning_item(item_id: str, text: str | None, status: str | None = "completed") -> Item:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[Item]:
    """A chat completion's message (a dict as the chat endpoint answers it) as output items:
    reasoning, then the text (left out when empty, as vLLM), then one item per tool call."""
    items: list[Item] = []
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, status=None))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], logprobs))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def response_logprobs(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    """The chat endpoint's ``logprobs.content`` as an output_text's ``logprobs`` (the same fields)."""
    if not chat_logprobs:
        return None
    return [{"token": entry["token"], "logprob": entry["logprob"], "bytes": entry.get("bytes"),
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"], "bytes": top.get("bytes")}
                              for top in entry.get("top_logprobs") or []]}
            for entry in chat_logprobs.get("content") or []]


def usage_body(chat_usage: dict[str, Any] | None, reasoning_tokens: int = 0) -> dict[str, Any] | None:
    """The chat usage as the Responses usage (vLLM's ``ResponseUsage``)."""
    if chat_usage is None:
        return None
    prompt, generated = chat_usage["prompt_tokens"], chat_usage["completion_tokens"]
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": generated,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens, "tool_output_tokens": 0},
            "total_tokens": prompt + generated}


def status_of(finish_reason: str | None) -> str:
    """A finished response's status: cut off by ``max_output_tokens`` is "incomplete"."""
    if finish_reason == "length":
        return "incomplete"
    if finish_reason == "abort":
        return "cancelled"
    return "completed"


@dataclass(frozen=True)
class Shell:
    """What every state of one response says about its request (vLLM's ``from_request``)."""

    response_id: str
    created_at: int
    model: str
    body: ResponsesRequest
    temperature: float
    top_p: float
    max_output_tokens: int | None

    def response(self, status: str, output: list[Item] | None = None, usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        response: dict[str, Any] = {
            "id": self.response_id, "created_at": self.created_at, "incomplete_details": incomplete,
            "instructions": body.instructions, "metadata": body.metadata, "model": self.model, "object": "response",
            "output": output or [], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": self.temperature, "tool_choice": body.tool_choice, "tools": body.tools,
            "top_p": self.top_p, "background": body.background, "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "previous_response_id": body.previous_response_id,
            "prompt": None, "reasoning": body.reasoning, "service_tier": body.service_tier, "status": status,
            "text": body.text, "top_logprobs": body.top_logprobs, "truncation": body.truncation, "usage": usage,
            "user": body.user,
        }
        if error is not None:
            response["error"] = error
        return response
