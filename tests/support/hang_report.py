"""A hang report: every thread's stack of this process and of each actor process below it (SIGUSR1:
``runtime/process.py``), with the tail of each actor's log, in one file (``tests/gpu/conftest.py``
writes one shortly before pytest-timeout stops a GPU test). Linux only (``/proc``).
"""

from __future__ import annotations

import faulthandler
import os
import re
import time
from pathlib import Path
from signal import SIGUSR1

import pytest

LOG_TAIL_LINES = 120
ACTOR_MODULE = "vllm_actors.runtime.actor_main"


def timeout_of(item: pytest.Item) -> float:
    """pytest-timeout's limit for ``item`` in seconds (0: none)."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        return float(marker.args[0])
    option = item.config.getoption("timeout", default=None)
    if option is not None:
        return float(option)
    try:
        return float(item.config.getini("timeout") or 0)
    except (ValueError, KeyError):
        return 0.0


def _descendants(root: int) -> list[int]:
    """The processes below ``root`` (from /proc: Linux, as the GPU machines are)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _read(path: Path) -> str:
    try:
        return path.read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _log_tail(pid: int) -> str:
    """The last lines of the file the process's stderr goes to (an actor's log)."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return ""
    if not target.startswith("/") or not Path(target).is_file():
        return f"(stderr: {target})"
    lines = _read(Path(target)).splitlines()
    return f"(stderr: {target})\n" + "\n".join(lines[-LOG_TAIL_LINES:])


def write_hang_report(path: Path, test_id: str, settle: float = 2.0) -> None:
    """Every thread's stack of this process, then of each actor process below it, into ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as report:
        report.write(f"hang report of {test_id} at {time.strftime('%H:%M:%S')}\n\n=== test process {os.getpid()}\n")
        report.flush()
        faulthandler.dump_traceback(file=report, all_threads=True)
        processes = _descendants(os.getpid())
        actors = [pid for pid in processes if ACTOR_MODULE in _read(Path(f"/proc/{pid}/cmdline"))]
        for pid in actors:  # only actors: SIGUSR1 ends a process without the handler
            try:
                os.kill(pid, SIGUSR1)
            except OSError:
                pass
        time.sleep(settle)  # each writes its stacks to its log
        for pid in processes:
            command = _read(Path(f"/proc/{pid}/cmdline"))
            spec = re.search(r'"actor_id":\s*"([^"]+)"', command)
            name = spec.group(1) if spec else command[:120]
            report.write(f"\n=== process {pid} ({name})\n{_log_tail(pid) if pid in actors else ''}\n")
