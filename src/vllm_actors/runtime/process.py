"""The contract between an actor process and its supervisor (``runtime/supervisor.py``).

- The spec: one JSON-encoded ``ActorSpec`` on the command line.
- stdin is a pipe from the supervisor; EOF on it means the supervisor is gone (even by SIGKILL),
  and the actor exits (``watch_parent``);
- exactly one JSON line on stdout: ``{"status": "ready", "info": {...}}`` once the actor serves,
  or ``{"status": "error", "error": "..."}`` (``report``); logs go to stderr;
- SIGTERM or SIGINT set the stop event (``install_signal_handlers``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from typing import Any

import msgspec

from vllm_actors.protocol.config import EngineConfig, SchedulerConfig
from vllm_actors.runtime.run_dir import GroupAddresses

HARD_EXIT_SECONDS = 3.0
READY_TIMEOUT = 60.0


class ActorSpec(msgspec.Struct, kw_only=True):
    role: str  # "bus", "metrics", "worker", "kv_cache_manager", "scheduler"
    actor_id: str
    addresses: GroupAddresses
    engine: EngineConfig
    scheduler: SchedulerConfig | None = None
    num_blocks: int = 0
    rank: int = 0
    check_invariants: bool = False
    metrics_max_events: int = 100_000


def report(status: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"status": status, **fields}) + "\n")
    sys.stdout.flush()


def watch_parent(stop: threading.Event) -> None:
    """Exit when the supervisor's end of our stdin closes (it died or let us go)."""

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(1024):
                pass
        except (OSError, ValueError):
            pass
        stop.set()
        timer = threading.Timer(HARD_EXIT_SECONDS, os._exit, args=(3,))
        timer.daemon = True
        timer.start()

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def install_signal_handlers(stop: threading.Event) -> None:
    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
