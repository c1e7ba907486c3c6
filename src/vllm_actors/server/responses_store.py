"""Stored responses (``store``, the default): the response object and the conversation it ends,
for ``GET /v1/responses/{id}``, ``previous_response_id`` and cancelling a background response.
Bounded: at most ``VLLM_ACTORS_RESPONSES_STORE_SIZE`` responses, the least recently used dropped
first (vLLM keeps every response in a dict that only grows)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.server.responses_background import EventLog


@dataclass
class Stored:
    response: dict[str, Any]
    history: list[dict[str, Any]]  # the chat messages up to and including this response's output
    task: asyncio.Task[None] | None = None  # a background response still running
    streams: list[RequestStream] = field(default_factory=list)
    events: EventLog | None = None  # a background stream's events, for GET ?stream=true


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.tasks: set[asyncio.Task[None]] = set()  # background responses running (the loop holds tasks weakly)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> Stored | None:
        found = self._entries.get(response_id)
        if found is not None:
            self._entries.move_to_end(response_id)
        return found

    def put(self, response_id: str, stored: Stored) -> None:
        """Keep ``stored``, unless the response was cancelled meanwhile (vLLM's rule); the events of
        a background stream stay with the response that replaces its running state."""
        previous = self._entries.get(response_id)
        if previous is not None and previous.response["status"] == "cancelled":
            return
        if previous is not None and stored.events is None:
            stored.events = previous.events
        self._entries[response_id] = stored
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)


def history_after(messages: list[dict[str, Any]], output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation once ``output`` (output items) answered ``messages``: text and function
    calls as one assistant turn (reasoning is not replayed, as chat templates drop past thinking)."""
    text = "".join(part.get("text", "") for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if not text and not calls:
        return list(messages)
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        turn["tool_calls"] = calls
    return [*messages, turn]
