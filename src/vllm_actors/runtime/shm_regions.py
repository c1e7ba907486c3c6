"""Where a replica set's shared-memory regions live (borrowed KV's exchange, ``models/kv_borrow_shm.py``)
and their removal with the set's run directory: a worker killed by a signal cannot remove its own, so the
supervisor removes them when it stops the group, and a sweep of orphaned run directories does too.
Torch-free: the supervisor imports it."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

SHM_FOLDER = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


def region_prefix(run_dir: str | Path) -> str:
    """A name prefix for one replica set's regions (its run directory's, hashed: short, unique per set)."""
    return "vllm-actors-kv-" + hashlib.sha1(os.path.abspath(run_dir).encode()).hexdigest()[:12]


def remove_regions(run_dir: str | Path) -> list[Path]:
    """Remove the set's region files left behind; returns them."""
    removed = []
    for path in SHM_FOLDER.glob(region_prefix(run_dir) + "-*"):
        try:
            path.unlink()
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
