"""The supervisor's children: one ``Child`` per actor process (its pipes, its log), the errors
of starting and losing one, its status lines, and stopping them all (the engine actors newest
first, then the metrics store, then the bus: SIGTERM, then SIGKILL after the grace period) with the
run directory."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.runtime.monitor import LineReader
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.shm_regions import remove_regions

log = structlog.get_logger(__name__)

MONITOR_JOIN_SECONDS = 30.0  # how long stopping waits for the monitor thread


class ActorStartError(RuntimeError):
    """An actor did not come up: names the actor and why, with the end of its log."""


class ActorDiedError(RuntimeError):
    """The group failed (an actor died past the restart budget, or could not start again): the reason."""


class Stopping(Exception):
    """The group is shutting down while the monitor restarts a child."""


@dataclass
class Child:
    actor_id: str
    role: str
    process: subprocess.Popen[bytes]
    log_path: Path
    spec: ActorSpec
    reader: LineReader = field(init=False)
    last_error: str | None = None  # an error line the child reported after READY

    def __post_init__(self) -> None:
        assert self.process.stdout is not None
        self.reader = LineReader(self.process.stdout)

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


def status_line(child: Child, line: bytes) -> dict[str, Any] | None:
    """A child's status line as a dict; None (logged) for anything else a library printed."""
    try:
        status = json.loads(line)
    except ValueError:
        status = None
    if not isinstance(status, dict):
        log.warning("not a status line on the actor's stdout", actor=child.actor_id, line=line[:200])
        return None
    return status


def cleanup(children: list[Child], run_dir: Path, grace: float, stop: threading.Event,
             monitor: list[threading.Thread], done: threading.Event) -> None:
    """Stop the monitor, then every child (newest first), then remove the run directory; ``done``
    once all that is over. Runs once (``weakref.finalize``)."""
    try:
        stop_all(children, run_dir, grace, stop, monitor)
    finally:
        done.set()


# Stopped last, in this order, so that the engine actors' last events (STOPPED) still reach the
# bus and the store; a publisher whose bus is gone would also hold its exit for its linger.
STOP_LAST = ("metrics", "bus")
LAST_PHASE_MIN_SECONDS = 1.0  # the bus and the store get at least this long, whatever came before


def stop_all(children: list[Child], run_dir: Path, grace: float, stop: threading.Event,
              monitor: list[threading.Thread]) -> None:
    """Stop the monitor, then every child: the engine actors (newest first), then the metrics
    store, then the bus; each SIGTERMed, SIGKILLed if still there when the grace period is over."""
    stop.set()
    for thread in monitor:
        if thread is not threading.current_thread():
            thread.join(MONITOR_JOIN_SECONDS)
    newest_first = list(reversed(children))
    phases = [[c for c in newest_first if c.role not in STOP_LAST],
              *([c for c in newest_first if c.role == role] for role in STOP_LAST)]
    deadline = time.monotonic() + grace
    for index, phase in enumerate(phases):
        if index:
            deadline = max(deadline, time.monotonic() + LAST_PHASE_MIN_SECONDS)
        _stop_phase(phase, deadline)
    children.clear()
    remove_regions(run_dir)  # a worker killed by a signal left its shared-memory regions
    shutil.rmtree(run_dir, ignore_errors=True)


def _stop_phase(children: list[Child], deadline: float) -> None:
    for child in children:
        if child.process.poll() is None:
            try:
                child.process.send_signal(signal.SIGTERM)
                child.process.send_signal(signal.SIGCONT)  # a stopped child can then handle it
            except ProcessLookupError:
                pass
    for child in children:
        remaining = max(deadline - time.monotonic(), 0.0)
        try:
            child.process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
        child.close_pipes()
