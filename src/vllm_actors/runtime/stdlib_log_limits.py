"""The same bounds for loggers of the standard library (uvicorn's): a ``logging.Filter`` letting
at most ``per_key`` records a second through per (level, message template), then one "log lines
suppressed" record with the count; an exception's traceback dropped (kept in one ``error=`` part
of the message) unless the level is DEBUG. ``install`` puts one on each named logger.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from vllm_actors.runtime.log_processors import MAX_KEYS, SUPPRESSED_EVENT


class StdlibLogLimit(logging.Filter):
    def __init__(self, per_key: int, debug: bool = False, window: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.per_key = per_key
        self.debug = debug
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[int, str], list[float]] = {}  # key -> [start, count, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_vllm_actors_summary", False):
            return True
        key = (record.levelno, str(record.msg)[:200])
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None:
                if len(self._windows) >= MAX_KEYS:
                    del self._windows[next(iter(self._windows))]
                window = self._windows[key] = [now, 0.0, 0.0]
            if now - window[0] >= self.window:
                suppressed = int(window[2])
                window[0], window[1], window[2] = now, 0.0, 0.0
                if suppressed:
                    self._summarise(record, suppressed)
            window[1] += 1
            if self.per_key > 0 and window[1] > self.per_key:
                window[2] += 1
                return False
        if record.exc_info and not self.debug:
            error = record.exc_info[1]
            if error is not None:
                record.msg = f"{record.getMessage()} error={type(error).__name__}: {error}"[:2000]
                record.args = None
            record.exc_info = None
            record.exc_text = None
        return True

    def _summarise(self, record: logging.LogRecord, count: int) -> None:
        summary = logging.LogRecord(record.name, record.levelno, record.pathname, record.lineno,
                                    f"{SUPPRESSED_EVENT} like=%r suppressed=%d seconds=%s",
                                    (str(record.msg)[:200], count, self.window), None)
        summary._vllm_actors_summary = True
        logging.getLogger(record.name).handle(summary)


def install(names: Iterable[str], per_key: int, debug: bool = False) -> list[StdlibLogLimit]:
    """One limit on each named logger (the records logged on it)."""
    limits = []
    for name in names:
        limit = StdlibLogLimit(per_key, debug=debug)
        logger = logging.getLogger(name)
        logger.addFilter(limit)
        limits.append(limit)
    return limits
