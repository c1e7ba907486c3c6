"""Tool calls out of what structured outputs made the model write (``tool_parser``'s interface,
as pure state machines): ``NamedCallParser`` for tool_choice naming a function (the output is its
arguments), ``RequiredCallsParser`` for tool_choice "required" (a JSON array of
``{"name", "parameters"}``, the schema vLLM constrains it to). Both stream as OpenAI does: a call's
id and name first, then its arguments in fragments as generated."""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from vllm_actors.server.tool_parser import CallDelta, JsonStrings, JsonValueScanner, ParsedDelta, new_tool_call_id

_PARAMETERS_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:', re.DOTALL)


class NamedCallParser:
    """tool_choice naming a function: the whole output is its arguments."""

    def __init__(self, name: str, make_id: Callable[[], str] = new_tool_call_id) -> None:
        self._name = name
        self._make_id = make_id
        self.count = 0

    def feed(self, text: str) -> ParsedDelta:
        if self.count == 0:
            if not text:
                return ParsedDelta()
            self.count = 1
            return ParsedDelta(calls=[CallDelta(0, text, self._make_id(), self._name)])
        return ParsedDelta(calls=[CallDelta(0, text)] if text else [])

    def finish(self) -> ParsedDelta:
        if self.count == 0:  # nothing generated: still the call, with empty arguments
            self.count = 1
            return ParsedDelta(calls=[CallDelta(0, "", self._make_id(), self._name)])
        return ParsedDelta()


class RequiredCallsParser:
    """tool_choice "required": ``[{"name": ..., "parameters": {...}}, ...]``. A call goes out as
    its name is read, then its parameters in fragments (as ``HermesToolParser``); an element with
    its keys the other way round goes out whole once it closes. Output that is not such an array
    is content."""

    def __init__(self, make_id: Callable[[], str] = new_tool_call_id) -> None:
        self._make_id = make_id
        self._text = ""
        self._depth = 0
        self._strings = JsonStrings()
        self._element_start = -1  # where the open element of the array starts in _text
        self._header = False
        self._scanner = JsonValueScanner()
        self._scanned = 0
        self.count = 0

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        base = len(self._text)
        self._text += text
        for offset, char in enumerate(text):
            if self._strings.quoted(char):
                continue
            if char in "{[":
                self._depth += 1
                if self._depth == 2 and char == "{":
                    self._element_start = base + offset
                    self._header = False
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1 and char == "}" and self._element_start >= 0:
                    end = base + offset + 1
                    self._advance(out, end)
                    if not self._header:
                        self._whole(out, self._text[self._element_start:end])
                    self._element_start = -1
        if self._element_start >= 0:
            self._advance(out, len(self._text))
        return out

    def finish(self) -> ParsedDelta:
        if self.count == 0 and self._text.strip():
            return ParsedDelta(content=self._text)  # not a call: what the model wrote
        return ParsedDelta()

    def _advance(self, out: ParsedDelta, end: int) -> None:
        if not self._header:
            match = _PARAMETERS_HEADER.match(self._text, self._element_start, end)
            if match is None:
                return
            try:
                name = json.loads(match.group(1))
            except (ValueError, RecursionError):
                return
            out.calls.append(CallDelta(self.count, "", self._make_id(), name))
            self.count += 1
            self._header = True
            self._scanner = JsonValueScanner()
            self._scanned = match.end()
        if not self._scanner.done:
            piece, used = self._scanner.take(self._text[self._scanned:end])
            self._scanned += used
            if piece:
                out.calls.append(CallDelta(self.count - 1, piece))

    def _whole(self, out: ParsedDelta, text: str) -> None:
        try:
            call = json.loads(text)
        except (ValueError, RecursionError):
            return
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = json.dumps(call.get("parameters", {}), ensure_ascii=False)
            out.calls.append(CallDelta(self.count, arguments, self._make_id(), call["name"]))
            self.count += 1
