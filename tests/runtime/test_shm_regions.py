"""A replica set's shared-memory regions (borrowed KV's exchange) go with its run directory: the
supervisor removes what a worker killed by a signal left, and so does the sweep of orphaned run
directories (their owner gone)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_actors.runtime import run_dir as run_dirs
from vllm_actors.runtime.shm_regions import SHM_FOLDER, region_prefix, remove_regions


def test_a_sets_regions_are_removed_by_prefix_and_no_other_sets(tmp_path: Path) -> None:
    mine, other = tmp_path / "g1", tmp_path / "g2"
    assert region_prefix(mine) == region_prefix(str(mine) + "/") != region_prefix(other)  # one name per folder
    files = [SHM_FOLDER / f"{region_prefix(mine)}-q0", SHM_FOLDER / f"{region_prefix(mine)}-r0-1"]
    kept = SHM_FOLDER / f"{region_prefix(other)}-q0"
    try:
        for path in (*files, kept):
            path.write_bytes(b"x")
        assert sorted(remove_regions(mine)) == sorted(files)
        assert not any(path.exists() for path in files) and kept.exists()
        assert remove_regions(mine) == []
    finally:
        kept.unlink(missing_ok=True)


def test_the_sweep_of_an_orphaned_run_directory_removes_its_regions(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    orphan = tmp_path / "g-orphan"
    orphan.mkdir()
    (orphan / run_dirs.OWNER_FILE).write_text(gone.stdout.strip())  # a pid that has exited
    region = SHM_FOLDER / f"{region_prefix(orphan)}-q1"
    region.write_bytes(b"x")
    try:
        assert run_dirs.sweep_orphaned_run_dirs(tmp_path) == [orphan]
        assert not region.exists() and not orphan.exists()
    finally:
        region.unlink(missing_ok=True)
