"""The supervisor's policy, pure: when a child counts as hung, and whether one more restart is allowed.

No processes, sockets or sleeps here; the clock is injected (``time.monotonic`` in the
supervisor, a fake one in the tests). ``runtime/monitor.py`` applies it to real processes.
"""

from __future__ import annotations

import signal
from collections import deque
from collections.abc import Callable

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW = 60.0
DEFAULT_LIVENESS_TIMEOUT = 5.0
DEFAULT_MAX_BUSY_SECONDS = 300.0


class RestartBudget:
    """At most ``max_restarts`` restarts in any ``window`` seconds, for the whole group."""

    def __init__(self, max_restarts: int, window: float, clock: Callable[[], float]) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        if window <= 0:
            raise ValueError(f"restart_window must be > 0, got {window}")
        self.max_restarts = max_restarts
        self.window = window
        self._clock = clock
        self._restarts: deque[float] = deque()

    def _expire(self, now: float) -> None:
        while self._restarts and now - self._restarts[0] >= self.window:
            self._restarts.popleft()

    def used(self) -> int:
        """Restarts within the last ``window`` seconds."""
        self._expire(self._clock())
        return len(self._restarts)

    def try_spend(self) -> bool:
        """Record one restart if the budget allows it; False (nothing recorded) when it is spent."""
        now = self._clock()
        self._expire(now)
        if len(self._restarts) >= self.max_restarts:
            return False
        self._restarts.append(now)
        return True

    def describe(self) -> str:
        return f"{self.max_restarts} restarts in {self.window:g} s"


class Liveness:
    """Per child: when its last ping arrived and how long it said its current message took.

    A child is hung when no ping came for ``timeout`` seconds (a stopped or wedged process: its
    ping thread stops too) or when one message has kept it busy for more than ``max_busy`` seconds
    (a stuck handler in a process that still pings)."""

    def __init__(self, timeout: float, max_busy: float, clock: Callable[[], float]) -> None:
        if timeout <= 0 or max_busy <= 0:
            raise ValueError(f"liveness_timeout and max_busy_seconds must be > 0, got {timeout}, {max_busy}")
        self.timeout = timeout
        self.max_busy = max_busy
        self._clock = clock
        self._last: dict[str, float] = {}
        self._busy: dict[str, float] = {}

    def started(self, actor: str) -> None:
        """The child (re)started or its monitoring (re)begins: its silence counts from now."""
        self._last[actor] = self._clock()
        self._busy[actor] = 0.0

    def ping(self, actor: str, busy: float) -> None:
        self._last[actor] = self._clock()
        self._busy[actor] = busy

    def forget(self, actor: str) -> None:
        self._last.pop(actor, None)
        self._busy.pop(actor, None)

    def silent_for(self, actor: str) -> float:
        return self._clock() - self._last.get(actor, self._clock())

    def verdict(self, actor: str) -> str | None:
        """None while the child looks alive, else why it counts as hung."""
        if actor not in self._last:
            return None
        silent = self.silent_for(actor)
        if silent >= self.timeout:
            return f"no liveness ping for {silent:.1f} s (limit {self.timeout:g} s)"
        busy = self._busy.get(actor, 0.0)
        if busy > self.max_busy:
            return f"busy on one message for {busy:.1f} s (limit {self.max_busy:g} s)"
        return None


def exit_detail(returncode: int) -> str:
    """How a child ended, from ``Popen.returncode`` (negative: killed by that signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exit code {returncode}"
