"""What the benchmarks and tests read of local processes (Linux ``/proc``) and ports."""

from __future__ import annotations

import socket
from pathlib import Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (every thread's)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return children


def rss_bytes(pid: int) -> int | None:
    """The process's resident memory (VmRSS), None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
