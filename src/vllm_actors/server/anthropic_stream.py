"""The chat path's event stream as Anthropic's (vLLM 0.26's ``message_stream_converter``):

``message_start`` (usage: the prompt's tokens), then each content block opened, filled and
closed in turn (``content_block_start``, ``content_block_delta`` with ``thinking_delta``,
``text_delta`` or ``input_json_delta``, ``content_block_stop``; a thinking block ends with its
``signature_delta``), ``message_delta`` (stop reason, final usage) and ``message_stop``. Text that
comes while a tool call is open is held and sent as a text block after it. A failure of the chat
stream becomes an ``error`` event that ends the stream. Like vLLM, no ``ping`` is sent.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.server.anthropic_convert import stop_of
from vllm_actors.server.anthropic_protocol import anthropic_error, error_type, event, usage_body


@dataclass
class _Blocks:
    """The content blocks sent so far: the open one (its type, tool call id, a thinking block's
    signature still to send) and the text held while a tool call is open."""

    next_index: int = 0
    called: bool = False  # a tool_use block was sent
    open_type: str | None = None
    tool_id: str | None = None
    signature: str | None = None
    held: list[str] = field(default_factory=list)

    def start(self, block: dict[str, Any]) -> list[bytes]:
        self.open_type = block["type"]
        self.called |= block["type"] == "tool_use"
        self.tool_id = block.get("id")
        self.signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        return [event("content_block_start", {"index": self.next_index, "content_block": block})]

    def delta(self, delta: dict[str, Any]) -> bytes:
        return event("content_block_delta", {"index": self.next_index, "delta": delta})

    def stop(self) -> list[bytes]:
        if self.open_type is None:
            return []
        events = []
        if self.signature is not None:
            events.append(self.delta({"type": "signature_delta", "signature": self.signature}))
        events.append(event("content_block_stop", {"index": self.next_index}))
        self.open_type = self.tool_id = self.signature = None
        self.next_index += 1
        return events

    def stop_and_flush(self) -> list[bytes]:
        """Close the open block, then send the held text as a block of its own."""
        events = self.stop()
        if self.held:
            text, self.held = "".join(self.held), []
            events += self.start({"type": "text", "text": ""})
            events.append(self.delta({"type": "text_delta", "text": text}))
            events += self.stop()
        return events

    def text(self, kind: str, text: str) -> list[bytes]:
        """A thinking or text delta, in a block of its kind (opened here when another is open)."""
        if kind == "text" and self.open_type == "tool_use":
            self.held.append(text)
            return []
        events = []
        if self.open_type != kind:
            events += self.stop_and_flush()
            events += self.start({"type": kind, kind: ""})
        events.append(self.delta({"type": f"{kind}_delta", kind: text}))
        return events


async def _payloads(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream, however its bytes were cut."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *frames, pending = pending.split(b"\n\n")
        for frame in frames:
            for line in frame.split(b"\n"):
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()


async def anthropic_events(chat_events: AsyncIterator[bytes], stop_sequences: list[str] | None) -> AsyncIterator[bytes]:
    """Anthropic's events for the chat path's SSE body ``chat_events`` (closed at the end, so
    that its own clean-up aborts the request when the client leaves)."""
    blocks = _Blocks()
    started = ended = False
    finish: tuple[Any, Any] = (None, None)  # the choice's finish_reason and stop_reason
    tool_ids: dict[int, str] = {}  # a streamed call's index -> its id
    try:
        async for payload in _payloads(chat_events):
            if payload == "[DONE]":
                for chunk in blocks.stop_and_flush():
                    yield chunk
                if not ended:
                    yield _message_delta(finish, stop_sequences, blocks.called, None)
                yield event("message_stop", {})
                return
            body = json.loads(payload)
            if "choices" not in body:  # the chat stream failed: its error, in Anthropic's shape, ends ours
                error = body.get("error") or {}
                yield event("error", {"error": anthropic_error(str(error.get("message", "")),
                                                               error_type(int(error.get("code") or 500)))["error"]})
                return
            if not started:
                started = True
                yield event("message_start", {"message": {
                    "id": body["id"], "type": "message", "role": "assistant", "content": [], "model": body["model"],
                    "stop_reason": None, "stop_sequence": None, "usage": usage_body(body.get("usage"))}})
            if not body["choices"]:  # the last chunk: the usage of the whole request
                for chunk in blocks.stop_and_flush():
                    yield chunk
                ended = True
                yield _message_delta(finish, stop_sequences, blocks.called, body.get("usage"))
                continue
            choice = body["choices"][0]
            if choice.get("finish_reason") is not None:
                finish = (choice["finish_reason"], choice.get("stop_reason"))
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                for chunk in blocks.text("thinking", reasoning):
                    yield chunk
            if delta.get("content"):
                for chunk in blocks.text("text", delta["content"]):
                    yield chunk
            for call in delta.get("tool_calls") or ():
                for chunk in _tool_call(blocks, tool_ids, call):
                    yield chunk
    finally:
        closer = getattr(chat_events, "aclose", None)
        if closer is not None:
            await closer()


def _tool_call(blocks: _Blocks, tool_ids: dict[int, str], call: dict[str, Any]) -> list[bytes]:
    """A streamed tool call's piece: the first (with its id and name) opens a ``tool_use`` block,
    its arguments come as ``input_json_delta``."""
    events = []
    function = call.get("function") or {}
    if call.get("id") is not None:
        tool_ids[call["index"]] = call["id"]
        if blocks.tool_id != call["id"] and function.get("name") is not None:
            events += blocks.stop_and_flush()
            events += blocks.start({"type": "tool_use", "id": call["id"], "name": function["name"], "input": {}})
    call_id = tool_ids.get(call["index"])
    if function.get("arguments") and call_id is not None and blocks.tool_id == call_id:
        events.append(blocks.delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
    return events


def _message_delta(finish: tuple[Any, Any], stop_sequences: list[str] | None, called: bool,
                   usage: dict[str, Any] | None) -> bytes:
    stop_reason, stop_sequence = stop_of(finish[0] or "stop", finish[1], stop_sequences, called)
    return event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                   "usage": usage_body(usage)})
