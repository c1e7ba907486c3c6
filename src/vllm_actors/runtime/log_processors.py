"""structlog processors that keep every process's log bounded, whatever its peers and clients send.

* ``RateLimiter``: at most ``per_key`` lines a second per (level, event) and ``total`` lines a
  second in all; past that, lines are dropped and counted, and once the second is over one
  "log lines suppressed" line says how many (on the next line logged, whatever it is: there is
  no timer thread). A flood of malformed frames costs ten lines a second, not one per frame.
* ``OneLineErrors``: an exception (``log.exception``, ``exc_info=...``) becomes one line,
  ``error="Type: message"`` and ``where="file.py:123 in function"`` (the innermost frame);
  the traceback is rendered only at DEBUG, plainly (no local variables).
* ``cap_values``: the event on one line, and every value's text at most ``MAX_VALUE_CHARS``
  (a 60 KB request id in a log line is cut, saying how much).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import structlog

EventDict = MutableMapping[str, Any]

MAX_VALUE_CHARS = 1_000
MAX_KEYS = 1_024  # (level, event) pairs followed; the oldest are forgotten
_ALL = ("*", "*")  # the key of the total
_SUMMARY = "_suppressed_summary"  # marks our own summary lines (never limited)
SUPPRESSED_EVENT = "log lines suppressed"


@dataclass(slots=True)
class _Window:
    start: float
    count: int = 0
    suppressed: int = 0


class RateLimiter:
    """A structlog processor: see the module. ``clock`` (seconds, monotonic) is for tests."""

    def __init__(self, per_key: int = 10, total: int = 100, window: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.per_key = per_key
        self.total = total
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str], _Window] = {}
        self._pending: dict[tuple[str, str], _Window] = {}  # windows with lines suppressed

    def __call__(self, logger: Any, method_name: str, event_dict: EventDict) -> EventDict:
        if event_dict.pop(_SUMMARY, False):
            return event_dict
        now = self._clock()
        key = (method_name, str(event_dict.get("event"))[:200])
        with self._lock:
            due = self._due(now) if self._pending else []
            allowed = self._admit(key, self.per_key, now) and self._admit(_ALL, self.total, now)
        for (level, event), count in due:
            _summarise(level, event, count, self.window)
        if not allowed:
            raise structlog.DropEvent
        return event_dict

    def _admit(self, key: tuple[str, str], limit: int, now: float) -> bool:
        window = self._windows.get(key)
        if window is None:
            if len(self._windows) >= MAX_KEYS:
                oldest = next(iter(self._windows))
                del self._windows[oldest]
                self._pending.pop(oldest, None)
            window = self._windows[key] = _Window(start=now)
        elif now - window.start >= self.window and not window.suppressed:
            window.start, window.count = now, 0
        window.count += 1
        if window.count <= limit:
            return True
        window.suppressed += 1
        self._pending[key] = window
        return False

    def _due(self, now: float) -> list[tuple[tuple[str, str], int]]:
        """Windows over with lines suppressed: their counts, the windows started afresh."""
        due: list[tuple[tuple[str, str], int]] = []
        for key, window in list(self._pending.items()):
            if now - window.start >= self.window:
                due.append((key, window.suppressed))
                window.start, window.count, window.suppressed = now, 0, 0
                del self._pending[key]
        return due


def _summarise(level: str, event: str, count: int, window: float) -> None:
    logger = structlog.get_logger("vllm_actors.log")
    method = "error" if level in ("exception", "critical") else level
    fields = {"like": event if event != "*" else "(any)", "suppressed": count, "seconds": window, _SUMMARY: True}
    getattr(logger, method, logger.warning)(SUPPRESSED_EVENT, **fields)


class OneLineErrors:
    """A structlog processor: see the module. ``debug``: keep the traceback (rendered plainly)."""

    def __init__(self, debug: bool) -> None:
        self.debug = debug

    def __call__(self, logger: Any, method_name: str, event_dict: EventDict) -> EventDict:
        event_dict.pop("stack_info", None)
        exc_info = event_dict.get("exc_info")
        if not exc_info:
            event_dict.pop("exc_info", None)
            return event_dict
        error = _exception(exc_info)
        if self.debug and error is not None:
            return event_dict
        event_dict.pop("exc_info", None)
        if error is None:
            return event_dict
        event_dict.setdefault("error", f"{type(error).__name__}: {error}")
        where = _innermost(error.__traceback__)
        if where:
            event_dict.setdefault("where", where)
        return event_dict


def _exception(exc_info: Any) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3 and isinstance(exc_info[1], BaseException):
        return exc_info[1]
    return sys.exc_info()[1]  # exc_info=True: the exception being handled


def _innermost(trace: TracebackType | None) -> str:
    if trace is None:
        return ""
    while trace.tb_next is not None:
        trace = trace.tb_next
    code = trace.tb_frame.f_code
    return f"{os.path.basename(code.co_filename)}:{trace.tb_lineno} in {code.co_name}"


def cap_values(logger: Any, method_name: str, event_dict: EventDict) -> EventDict:
    """A structlog processor: see the module."""
    for key, value in event_dict.items():
        if key == "exc_info" or value is None or isinstance(value, (bool, int, float)):
            continue
        if key == "event":
            text = str(value).replace("\r", "\\r").replace("\n", "\\n")
        else:
            text = value if isinstance(value, str) else repr(value)
        if len(text) > MAX_VALUE_CHARS:
            event_dict[key] = f"{text[:MAX_VALUE_CHARS]}...(+{len(text) - MAX_VALUE_CHARS} chars)"
        elif key == "event":
            event_dict[key] = text
    return event_dict
