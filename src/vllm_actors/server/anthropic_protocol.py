"""Anthropic's Messages API as vLLM 0.26 reads it (``vllm/entrypoints/anthropic/protocol.py``):
the request bodies of ``POST /v1/messages`` and ``/v1/messages/count_tokens``, the shapes of the
replies and errors, and the framing of the stream's events. Unknown fields are ignored (vLLM's
pydantic models ignore them too: clients send ``metadata``, ``thinking``, ``cache_control``...)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from vllm_actors.server.errors import OpenAIError, bad_request, error_body

BlockType = Literal["text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking"]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
# The chat path's finish reasons as Anthropic's stop reasons (vLLM's map; others become null).
STOP_REASONS: dict[str, StopReason] = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class ContentBlock(msgspec.Struct, kw_only=True):
    """One block of a message's (or the system prompt's) content; which fields count depends on ``type``."""

    type: BlockType
    text: str | None = None
    source: dict[str, Any] | None = None  # image
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    tool_name: str | None = None  # tool_reference
    thinking: str | None = None  # thinking
    signature: str | None = None
    data: str | None = None  # redacted_thinking


class AnthropicMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: what the prompt of these messages would hold."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's own field

    def check(self) -> None:
        """vLLM's checks beyond the types: a 400 naming the field."""
        if not self.model:
            raise bad_request("model: Model is required", "model")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and not self.tool_choice.name:
            raise bad_request("tool_choice: tool_choice.name is required when type is 'tool'", "tool_choice")


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages``."""

    max_tokens: int
    metadata: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    kv_transfer_params: dict[str, Any] | None = None  # vLLM's own field

    def check(self) -> None:
        super().check()
        if self.max_tokens <= 0:
            raise bad_request(f"max_tokens: max_tokens must be positive, got {self.max_tokens}", "max_tokens")


def usage_body(usage: dict[str, Any] | None) -> dict[str, int]:
    """The chat path's usage as Anthropic's (vLLM's rule): ``input_tokens`` leaves out the prompt
    tokens read from the prefix cache, which ``cache_read_input_tokens`` counts (present only
    with --enable-prompt-tokens-details, as vLLM)."""
    if not usage:
        return {"input_tokens": 0, "output_tokens": 0}
    body = {"input_tokens": int(usage.get("prompt_tokens") or 0),
            "output_tokens": int(usage.get("completion_tokens") or 0)}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        body["cache_read_input_tokens"] = int(cached)
        body["input_tokens"] = max(0, body["input_tokens"] - int(cached))
    return body


def error_type(status: int) -> str:
    """The ``type`` vLLM puts in an Anthropic error: its OpenAI error type (``BadRequestError``...)."""
    kind = error_body("", status)["error"]
    assert isinstance(kind, dict)
    return str(kind["type"])


def anthropic_error(message: str, kind: str) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_of(error: OpenAIError) -> dict[str, Any]:
    return anthropic_error(error.message, error_type(error.status))


def event(kind: str, data: dict[str, Any]) -> bytes:
    """One server-sent event as Anthropic frames it: its type named twice, on ``event:`` and in the data."""
    return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode({"type": kind, **data}) + b"\n\n"
