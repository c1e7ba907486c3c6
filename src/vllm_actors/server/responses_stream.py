"""The Responses API's streaming events, made from the chat endpoint's stream chunks:
``response.created`` and ``response.in_progress``; per output item ``response.output_item.added``,
its parts and deltas (``response.content_part.added``, ``response.output_text.delta``,
``response.reasoning_text.delta``, ``response.function_call_arguments.delta``), their ``.done``
events and ``response.output_item.done``; then ``response.completed`` with the whole response. Every
event carries its ``sequence_number``; an item is closed before the next one opens, so each
``done`` closes the last thing opened (what vLLM's event-stack tests check)."""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_actors.server.errors import OpenAIError
from vllm_actors.server.responses_items import (
    Item,
    Shell,
    function_call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
    response_logprobs,
    status_of,
    usage_body,
)

Event = dict[str, Any]


def sse_event(event: Event) -> bytes:
    """One event as Server-Sent Events send it (``event:`` line, then ``data:``), as vLLM does."""
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"


class ResponseEvents:
    """Turns one response's chat chunks (decoded dicts) into Responses events."""

    def __init__(self, shell: Shell) -> None:
        self.shell = shell
        self.items: list[Item] = []
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self._sequence = 0
        self._open: int | None = None  # output index of the item being streamed
        self._text = ""  # the open message's or reasoning's text so far
        self._logprobs: list[dict[str, Any]] = []
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index
        self._argument_deltas = 0  # deltas sent for the open function call

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def start(self) -> list[Event]:
        response = self.shell.response("in_progress")
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning") or delta.get("reasoning_content")
            if reasoning:
                events += self._reasoning(reasoning)
            if delta.get("content"):
                events += self._content(delta["content"], response_logprobs(choice.get("logprobs")) or [])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> tuple[list[Event], dict[str, Any]]:
        """The closing events and the finished response (in its ``response.completed`` event)."""
        events = self._close()
        response = self.shell.response(status_of(self.finish_reason), self.items, usage_body(self.usage))
        events.append(self._event("response.completed", response=response))
        return events, response

    def fail(self, error: OpenAIError) -> list[Event]:
        return [self._event("error", code=str(error.status), message=error.message, param=error.param)]

    # ------------------------------------------------------------------ items
    def _add(self, item: Item) -> Event:
        self.items.append(item)
        self._open = len(self.items) - 1
        self._text, self._logprobs, self._argument_deltas = "", [], 0
        return self._event("response.output_item.added", output_index=self._open, item=dict(item))

    def _content(self, text: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.items[self._open]["type"] != "message":
            events += self._close()
            item = message_item(new_id("msg"), None, status="in_progress")
            events.append(self._add(item))
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=self._open,
                                      content_index=0, part=output_text("", [])))
        assert self._open is not None
        self._text += text
        self._logprobs += logprobs
        events.append(self._event("response.output_text.delta", item_id=self.items[self._open]["id"],
                                  output_index=self._open, content_index=0, delta=text, logprobs=logprobs))
        return events

    def _reasoning(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.items[self._open]["type"] != "reasoning":
            events += self._close()
            item = reasoning_item(new_id("rs"), None, status="in_progress")
            events.append(self._add(item))
            events.append(self._event("response.reasoning_part.added", item_id=item["id"], output_index=self._open,
                                      content_index=0, part={"type": "reasoning_text", "text": ""}))
        assert self._open is not None
        self._text += text
        events.append(self._event("response.reasoning_text.delta", item_id=self.items[self._open]["id"],
                                  output_index=self._open, content_index=0, delta=text))
        return events

    def _call(self, call: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        function = call.get("function") or {}
        index = call.get("index", 0)
        if call.get("id") is not None and index not in self._calls:
            events += self._close()
            item = function_call_item(new_id("fc"), call["id"], function.get("name") or "", "", status="in_progress")
            events.append(self._add(item))
            self._calls[index] = len(self.items) - 1
        position = self._calls.get(index)
        arguments = function.get("arguments") or ""
        if position is None or not arguments:
            return events
        item = self.items[position]
        item["arguments"] += arguments
        if position == self._open:
            self._argument_deltas += 1
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=position, delta=arguments))
        return events

    def _close(self) -> list[Event]:
        """The done events of the open item, if any."""
        if self._open is None:
            return []
        index, item = self._open, self.items[self._open]
        self._open = None
        events: list[Event] = []
        if item["type"] == "message":
            part = output_text(self._text, self._logprobs or None)
            events.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=self._text, logprobs=self._logprobs))
            events.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self._text}
            events.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=self._text))
            events.append(self._event("response.reasoning_part.done", item_id=item["id"], output_index=index,
                                      content_index=0, part=part))
            item["content"] = [part]
        else:
            if not self._argument_deltas:  # every done closes a delta, even of empty arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=index, delta=item["arguments"]))
            events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=index, item=dict(item)))
        return events
