"""A surviving KV-parallel rank rejoins a new world without restarting (``models/kv_parallel_rejoin.py``),
over gloo in real processes: the survivor waits in an all-gather, its peer is SIGKILLed, the
all-gather fails at once (no hang), the survivor joins a new rendezvous with a respawned rank 1 and
gathers with it, its process the same throughout."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_actors.models.kv_parallel import KvParallel
from vllm_actors.models.kv_parallel_rejoin import rejoin_kv_parallel

ROOT = Path(__file__).resolve().parents[2]


def _rank(role: str, first: Path, second: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "tests.support.kvp_rejoin_rank", role, f"file://{first}",
                             f"file://{second}"], cwd=ROOT, stdout=subprocess.PIPE, text=True)


def test_survivor_rejoins_with_a_respawned_rank_in_its_own_process(tmp_path: Path) -> None:
    first, second = tmp_path / "first.store", tmp_path / "second.store"
    survivor, doomed = _rank("survivor", first, second), _rank("doomed", first, second)
    respawned = None
    try:
        assert survivor.stdout is not None and doomed.stdout is not None
        assert survivor.stdout.readline().split() == ["survivor", str(survivor.pid), "gathered", "[0.0,", "10.0]"]
        assert doomed.stdout.readline().split() == ["doomed", str(doomed.pid), "gathered", "[0.0,", "10.0]"]
        assert survivor.stdout.readline().split() == ["survivor", str(survivor.pid), "gathering"]
        doomed.send_signal(signal.SIGKILL)
        assert survivor.stdout.readline().split() == ["survivor", str(survivor.pid), "failed", "RuntimeError"]
        respawned = _rank("respawned", first, second)
        assert respawned.stdout is not None
        # the survivor's second value and the respawned rank's, gathered over the new world
        assert survivor.stdout.readline().split() == ["survivor", str(survivor.pid), "gathered", "[2.0,", "15.0]"]
        assert respawned.stdout.readline().split()[2:] == ["gathered", "[2.0,", "15.0]"]
        assert survivor.wait(timeout=60) == 0 and respawned.wait(timeout=60) == 0
    finally:
        for process in (survivor, doomed, respawned):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()


def test_only_a_lone_kv_parallel_rank_rejoins() -> None:
    with pytest.raises(ValueError, match="kv_parallel_size >= 2"):
        rejoin_kv_parallel(KvParallel(), "file:///nowhere", torch.device("cpu"))
    with pytest.raises(ValueError, match="tensor parallelism \\(2 ranks each\\)"):
        rejoin_kv_parallel(KvParallel(rank=0, size=2, world_size=4), "file:///nowhere", torch.device("cpu"))
