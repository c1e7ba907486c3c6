"""The contract between an actor process and its supervisor (``runtime/supervisor.py``).

- The spec: one JSON-encoded ``ActorSpec`` on the command line.
- stdin is a pipe from the supervisor; EOF on it means the supervisor is gone (even by SIGKILL),
  and the actor exits (``watch_parent``);
- stdout carries JSON lines only (``report``; logs go to stderr): first ``{"status": "ready",
  "info": {...}}`` once the actor serves, or ``{"status": "error", "error": "..."}``; after READY,
  a liveness ping ``{"status": "alive", "busy": <seconds>}`` every ``PING_INTERVAL`` seconds from a
  daemon thread, where ``busy`` is how long the message being handled has taken so far (0 when
  idle; ``set_busy_source``). A process that is stopped (SIGSTOP) or wedged stops pinging, and the
  supervisor's monitor declares it hung. Lines are written whole under one lock, with ``os.write``
  (no buffered stream a daemon thread could hold at interpreter exit), and a ping is skipped rather
  than blocking when the pipe is full;
- SIGTERM or SIGINT set the stop event (``install_signal_handlers``); SIGUSR1 writes every
  thread's Python stack to stderr (the actor's log file) and goes on: where a hung actor waits.
"""

from __future__ import annotations

import faulthandler
import json
import os
import select
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from vllm_actors.protocol.config import EngineConfig, SchedulerConfig
from vllm_actors.runtime import signal_wake
from vllm_actors.runtime.gc_tuning import freeze_startup_heap
from vllm_actors.runtime.run_dir import GroupAddresses

HARD_EXIT_SECONDS = 3.0
READY_TIMEOUT = 60.0
PING_INTERVAL = 0.5

_stdout_lock = threading.Lock()
_busy_source: Callable[[], float] = lambda: 0.0  # noqa: E731
_pinger: threading.Thread | None = None


class ActorSpec(msgspec.Struct, kw_only=True):
    role: str  # "bus", "metrics", "worker", "kv_cache_manager", "scheduler"
    actor_id: str
    addresses: GroupAddresses
    engine: EngineConfig
    scheduler: SchedulerConfig | None = None
    num_blocks: int = 0
    num_host_blocks: int = 0  # the KV-cache manager's host tier, in blocks
    rank: int = 0
    # A tensor-parallel worker's rendezvous (``file://`` in the run directory), new for every
    # start of the worker unit: the ranks of one start meet there.
    tp_init: str = ""
    check_invariants: bool = False
    metrics_max_events: int = 50_000  # the metrics store's DEFAULT_MAX_EVENTS
    incarnation: int = 0  # how many times the supervisor restarted this actor before
    run_dir: str = ""  # the group's run directory: its CURVE keys (TCP), the metrics store's dumps
    replica: int | None = None  # the replica of a scheduler, KV-cache manager or worker (None: the only one)
    # The controller of a set whose replicas Ray placed: each replica's attach directory (its
    # group.json and curve.keys, private to this user), in replica order. Empty: local replicas.
    remote_replicas: list[str] = []


def _write_line(fields: dict[str, Any], *, skip_if_full: bool = False) -> None:
    data = (json.dumps(fields) + "\n").encode()
    with _stdout_lock:
        if skip_if_full:
            # A pipe is writable when at least PIPE_BUF bytes are free: a short line then never blocks.
            _, writable, _ = select.select([], [1], [], 0)
            if not writable:
                return
        while data:
            data = data[os.write(1, data):]


def report(status: str, **fields: Any) -> None:
    """One status line for the supervisor; READY also starts the liveness pings and freezes the
    start-up heap out of the garbage collector's way (``gc_tuning``)."""
    if status == "ready":
        freeze_startup_heap()
    _write_line({"status": status, **fields})
    if status == "ready":
        start_pings()


def set_busy_source(busy: Callable[[], float]) -> None:
    """What the pings report as ``busy``: seconds spent so far on the message being handled."""
    global _busy_source
    _busy_source = busy


def start_pings(interval: float = PING_INTERVAL) -> None:
    """Start the ping thread (once per process)."""
    global _pinger
    if _pinger is not None:
        return

    def ping() -> None:
        while True:
            time.sleep(interval)
            try:
                busy = float(_busy_source())
                _write_line({"status": "alive", "busy": round(busy, 3)}, skip_if_full=True)
            except (OSError, ValueError):  # the supervisor closed the pipe: the parent watch exits us
                return

    _pinger = threading.Thread(target=ping, name="liveness-ping", daemon=True)
    _pinger.start()


def on_stdin_closed(callback: Callable[[], object]) -> None:
    """Call ``callback`` from a daemon thread once the parent's end of our stdin closes (it died,
    even by SIGKILL, or let us go)."""

    def watch() -> None:
        # os.read, not sys.stdin: a daemon thread blocked inside a buffered stream holds its lock,
        # and the interpreter aborts (SIGABRT) when it exits with that lock held.
        try:
            while os.read(0, 1024):
                pass
        except (OSError, ValueError):
            pass
        callback()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def watch_parent(stop: threading.Event) -> None:
    """Exit when the supervisor's end of our stdin closes: ``stop``, then a hard exit after
    ``HARD_EXIT_SECONDS``."""

    def gone() -> None:
        stop.set()
        timer = threading.Timer(HARD_EXIT_SECONDS, os._exit, args=(3,))
        timer.daemon = True
        timer.start()

    on_stdin_closed(gone)


def install_signal_handlers(stop: threading.Event) -> None:
    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal_wake.install()  # the loops see the stop at once, not at their poll's timeout
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: its stacks, on stderr
