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


def _log_path(pid: int) -> Path | None:
    """The file the process's stderr goes to (an actor's log), None when it is not a file."""
    try:
        target = os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return None
    return Path(target) if target.startswith("/") and Path(target).is_file() else None


def _alive(pid: int) -> bool:
    """Whether the process runs (not gone, not a zombie its parent has yet to reap)."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    return bool(stat) and stat.rsplit(")", 1)[1].split()[0] != "Z"


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def _dumped_since(path: Path | None, offset: int) -> bool:
    """Whether the log has a stack dump (a thread header and a frame) past ``offset``."""
    if path is None:
        return True  # nothing to wait for
    try:
        with path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
    except OSError:
        return True
    header = text.find("(most recent call first):")
    return header >= 0 and 'File "' in text[header:]


def _log_tail(pid: int) -> str:
    """The last lines of the file the process's stderr goes to (an actor's log)."""
    path = _log_path(pid)
    if path is None:
        return "(stderr: not a file)"
    lines = _read(path).splitlines()
    return f"(stderr: {path})\n" + "\n".join(lines[-LOG_TAIL_LINES:])


def write_hang_report(path: Path, test_id: str, settle: float = 2.0) -> None:
    """Every thread's stack of this process, then of each actor process below it, into ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as report:
        report.write(f"hang report of {test_id} at {time.strftime('%H:%M:%S')}\n\n=== test process {os.getpid()}\n")
        report.flush()
        faulthandler.dump_traceback(file=report, all_threads=True)
        processes = _descendants(os.getpid())
        actors = [pid for pid in processes if ACTOR_MODULE in _read(Path(f"/proc/{pid}/cmdline"))]
        logs = {pid: _log_path(pid) for pid in actors}
        offsets = {pid: _size(log) for pid, log in logs.items()}
        for pid in actors:  # only actors: SIGUSR1 ends a process without the handler
            try:
                os.kill(pid, SIGUSR1)
            except OSError:
                offsets.pop(pid)
        # each writes its stacks to its log; `settle` bounds the wait for one that cannot (stopped, dead)
        deadline = time.monotonic() + settle
        while time.monotonic() < deadline and not all(
                _dumped_since(logs[pid], at) or not _alive(pid) for pid, at in offsets.items()):
            time.sleep(0.01)
        for pid in processes:
            command = _read(Path(f"/proc/{pid}/cmdline"))
            spec = re.search(r'"actor_id":\s*"([^"]+)"', command)
            name = spec.group(1) if spec else command[:120]
            report.write(f"\n=== process {pid} ({name})\n{_log_tail(pid) if pid in actors else ''}\n")
