"""The `vllm-actors tap` command's process behaviour (its output format: state_machines/test_tap_format.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path


def test_tap_stops_on_sigint_even_when_started_with_sigint_ignored(tmp_path: Path) -> None:
    """A background job of a non-interactive shell starts with SIGINT ignored (CI's suite hung on a
    tap that never stopped): the tap restores Ctrl-C itself."""
    tap = subprocess.Popen(
        [sys.executable, "-m", "vllm_actors", "tap", "--address", f"ipc://{tmp_path}/bus_out", "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        assert tap.stderr is not None
        assert "tap attached" in tap.stderr.readline()
        tap.send_signal(signal.SIGINT)
        assert tap.wait(timeout=60) == 0
    finally:
        if tap.poll() is None:
            tap.kill()
            tap.wait()
