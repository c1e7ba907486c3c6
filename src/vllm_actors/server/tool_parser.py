"""Tool calls out of generated text, incrementally: pure state machines over text deltas (no
sockets, clocks or files; the tool-call ids come from ``make_id``).

``HermesToolParser`` reads the format Hermes and Qwen chat templates teach their models,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (one or several, text around them
is content), as vLLM's ``hermes`` parser: the first delta of a call carries its index, id and
name with empty arguments, then the arguments' text follows in fragments as it is generated.
Markup never reaches the content; a block that is not a tool call (bad JSON, no name) is given
back as content. Whitespace next to tool calls is dropped, but for one run between two pieces of
content (so "Sure. <tool_call>...</tool_call> Done." has the content "Sure. Done.").

``forced_tool_calls`` reads the output of a named function and of tool_choice "required" the same way.

Each parser: ``feed(text)`` -> ``ParsedDelta``, ``finish()`` -> ``ParsedDelta`` at the end of
the output; ``parse_all`` runs one over a whole text (a non-streamed response).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# the start of a call whose arguments can stream: '{"name": "<name>", "arguments":'
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:', re.DOTALL)


def new_tool_call_id() -> str:
    """vLLM's tool-call id: ``chatcmpl-tool-`` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class CallDelta:
    """A piece of tool call ``index``: its first carries ``id`` and ``name``."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def extend(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.calls.extend(other.calls)


@dataclass(frozen=True)
class ToolCallText:
    id: str
    name: str
    arguments: str


class ToolParser(Protocol):
    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


def parse_all(parser: ToolParser, text: str) -> tuple[str, list[ToolCallText]]:
    """(content, complete tool calls) of a whole output."""
    delta = parser.feed(text)
    delta.extend(parser.finish())
    return delta.content, merge_calls(delta.calls)


def merge_calls(deltas: list[CallDelta]) -> list[ToolCallText]:
    calls: dict[int, list[str]] = {}
    heads: dict[int, tuple[str, str]] = {}
    for delta in deltas:
        if delta.id is not None and delta.name is not None:
            heads[delta.index] = (delta.id, delta.name)
        calls.setdefault(delta.index, []).append(delta.arguments)
    return [ToolCallText(heads[i][0], heads[i][1], "".join(calls[i])) for i in sorted(heads)]


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that starts ``tag`` (a tag cut by the delta)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class JsonStrings:
    """Whether each character of a JSON text, fed in order, belongs to a string (escapes followed)."""

    __slots__ = ("inside", "_escape")

    def __init__(self) -> None:
        self.inside = False
        self._escape = False

    def quoted(self, char: str) -> bool:
        """True when ``char`` is part of a string, its quotes included."""
        if self.inside:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self.inside = False
            return True
        if char == '"':
            self.inside = True
            return True
        return False


class JsonValueScanner:
    """Follows one JSON object or array character by character: where it ends."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = False
        self.done = False
        self._strings = JsonStrings()

    def take(self, text: str) -> tuple[str, int]:
        """(the value's characters in ``text``, how many characters of ``text`` were used)."""
        out: list[str] = []
        used = 0
        for char in text:
            if self.done:
                break
            used += 1
            if not self.started:
                if char.isspace():
                    continue
                if char not in "{[":
                    self.done = True  # not an object: nothing to stream
                    used -= 1
                    break
                self.started = True
                quoted = False
            else:
                quoted = self._strings.quoted(char)
                if not quoted and char == "<":  # markup where JSON should go on: the value was cut short
                    self.done = True
                    used -= 1
                    break
            if not quoted and char in "{[":
                self.depth += 1
            elif not quoted and char in "}]":
                self.depth -= 1
            out.append(char)
            if self.started and self.depth == 0 and not self._strings.inside:
                self.done = True
        return "".join(out), used


class HermesToolParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks out of a text stream."""

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        self._make_id = make_id
        self._pending = ""  # outside a block: text not yet given out (a partial start tag)
        self._held = ""  # whitespace given out only if content follows
        self._strip_leading = False  # just after a block: its trailing whitespace is dropped
        self._in_block = False
        self._body = ""
        self._header = False  # the current block's id and name went out
        self._scanner = JsonValueScanner()
        self._scanned = 0  # how much of the body the arguments scanner has read
        self.count = 0  # tool calls started

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_block:
            self._body += text
        else:
            self._pending += text
        while True:
            if not self._in_block:
                start = self._pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_tag(self._pending, TOOL_CALL_START)
                    self._content(out, self._pending[:len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep:]
                    return out
                self._content(out, self._pending[:start])
                self._open(self._pending[start + len(TOOL_CALL_START):])
                self._pending = ""
            rest = self._block(out)
            if rest is None:
                return out
            self._pending = rest

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._in_block:
            self._in_block = False
            if not self._header:  # cut off before </tool_call>: a whole call still counts (vLLM)
                self._whole(out, self._body, closed=False)
        else:
            self._content(out, self._pending)
            self._pending = ""
        if self.count == 0 and self._held:
            out.content += self._held
        self._held = ""
        return out

    # ------------------------------------------------------------------ internals
    def _content(self, out: ParsedDelta, text: str) -> None:
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                return
            self._strip_leading = False
        text = self._held + text
        stripped = text.rstrip()
        self._held = text[len(stripped):]
        out.content += stripped

    def _open(self, body: str) -> None:
        self._in_block = True
        self._body = body
        self._header = False
        self._scanner = JsonValueScanner()
        self._scanned = 0

    def _block(self, out: ParsedDelta) -> str | None:
        """Advance the open block; the text after its end tag once it closes, else None."""
        if not self._header:
            match = _HEADER.match(self._body)
            if match is not None:
                try:
                    name = json.loads(match.group(1))
                except (ValueError, RecursionError):
                    name = None
                if isinstance(name, str) and name:
                    out.calls.append(CallDelta(self.count, "", self._make_id(), name))
                    self.count += 1
                    self._header = True
                    self._scanned = match.end()
        if self._header:
            if not self._scanner.done:
                piece, used = self._scanner.take(self._body[self._scanned:])
                self._scanned += used
                if piece:
                    out.calls.append(CallDelta(self.count - 1, piece))
            if not self._scanner.done:
                return None
            end = self._body.find(TOOL_CALL_END, self._scanned)
            if end < 0:
                return None
        else:
            end = self._body.find(TOOL_CALL_END)
            if end < 0:
                return None
            if not self._whole(out, self._body[:end], closed=True):
                self._in_block = False
                return self._body[end + len(TOOL_CALL_END):]
        self._in_block = False
        self._strip_leading = True  # the whitespace before the block goes out if content follows
        return self._body[end + len(TOOL_CALL_END):]

    def _whole(self, out: ParsedDelta, body: str, *, closed: bool) -> bool:
        """A block whose arguments could not stream: a call if it parses, else content."""
        try:
            call = json.loads(body)
        except (ValueError, RecursionError):
            call = None
        if (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
                and isinstance(call.get("arguments"), dict)):
            arguments = json.dumps(call["arguments"], ensure_ascii=False)
            out.calls.append(CallDelta(self.count, arguments, self._make_id(), call["name"]))
            self.count += 1
            return True
        self._strip_leading = False
        self._content(out, TOOL_CALL_START + body + (TOOL_CALL_END if closed else ""))
        return False
