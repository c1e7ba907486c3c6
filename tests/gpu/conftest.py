"""GPU tests: a test still running shortly before pytest-timeout stops it leaves a hang report.

A GPU test that hangs (a device wait that never returns, an NCCL point-to-point that never meets
its peer) is stopped by pytest-timeout with the test process's stack alone, and a session stopped
before pytest's summary loses even that. Here, ``HANG_MARGIN`` seconds before the timeout, every
thread's stack of the test process and of each actor process it started (SIGUSR1: ``runtime/
process.py``) goes to a file in ``$GPU_TEST_DUMP_DIR`` (default ``<tmp>/gpu-test-dumps``), with the
tail of each actor's log, and its path to the terminal. The actors log at INFO (their start-up
phases: ``model_runner_ready``, ``cuda_graphs_captured``), unless ``GPU_TEST_LOG_LEVEL`` says
otherwise.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.hang_report import timeout_of, write_hang_report

HANG_MARGIN = 20.0  # seconds before pytest-timeout's limit (at most a fifth of it)


@pytest.fixture(autouse=True)
def _actor_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """The actors this test starts log their phases (INFO), unless GPU_TEST_LOG_LEVEL says otherwise."""
    monkeypatch.setenv("VLLM_ACTORS_LOG_LEVEL", os.environ.get("GPU_TEST_LOG_LEVEL", "INFO"))


@pytest.fixture(autouse=True)
def _hang_report(request: pytest.FixtureRequest) -> Iterator[None]:
    timeout = timeout_of(request.node)
    if timeout <= 0:
        yield
        return
    folder = Path(os.environ.get("GPU_TEST_DUMP_DIR") or Path(tempfile.gettempdir()) / "gpu-test-dumps")
    path = folder / (re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.nodeid) + ".txt")
    capture: Any = request.config.pluginmanager.getplugin("capturemanager")

    def report() -> None:
        write_hang_report(path, request.node.nodeid)
        message = f"\n[hang report] {request.node.nodeid} still running: stacks and actor logs in {path}\n"
        if capture is not None:
            with capture.global_and_fixture_disabled():
                print(message, flush=True)
        else:
            print(message, flush=True)

    timer = threading.Timer(max(timeout - min(HANG_MARGIN, timeout / 5), 1.0), report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
