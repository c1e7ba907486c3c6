"""What the benchmarks and tests read of local processes (Linux ``/proc``) and ports."""

from __future__ import annotations

import os
import re
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


CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_tree(pid: int) -> list[int]:
    """The process and all its descendants alive now."""
    tree, frontier = [pid], [pid]
    while frontier:
        children = [child for parent in frontier for child in child_pids(parent)]
        tree += children
        frontier = children
    return tree


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of the process so far, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14 and 15 of stat


def process_role(pid: int) -> str:
    """What a server's process is: ``api`` (a ``serve`` process, this engine's or vLLM's, or an
    ``--api-server-count`` API process), an actor's role (from its spec on the command line), else
    its command name (vLLM's ``EngineCore``...)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    if "vllm_actors.server.api_process" in cmdline or " serve " in f" {cmdline} ":
        return "api"
    role = re.search(r'"role":\s*"([^"]+)"', cmdline)
    return role.group(1) if role else comm


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds so far of each role in the process tree under ``root`` (summed over processes)."""
    totals: dict[str, float] = {}
    for pid in process_tree(root):
        seconds = cpu_seconds(pid)
        if seconds is not None:
            role = process_role(pid)
            totals[role] = totals.get(role, 0.0) + seconds
    return totals


def cpu_shares(before: dict[str, float], after: dict[str, float], wall: float) -> dict[str, float]:
    """Each role's CPU over ``wall`` seconds, in cores (1.0: one core busy all along)."""
    return {role: round(max(after[role] - before.get(role, 0.0), 0.0) / wall, 3)
            for role in sorted(after) if wall > 0}
