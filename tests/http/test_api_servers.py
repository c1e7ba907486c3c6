"""``vllm-actors serve --api-server-count 2``: a second API process on the parent's port,
attached to the parent's group; restarted when it dies; gone with the parent, even a SIGKILLed one.

Which process accepts a connection is the kernel's choice, so a test that must reach the second
process stops the parent (SIGSTOP) for that request: then only the second process can answer."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.server_helpers import child_pids, free_port, gone, start_server, stop_process, tail, wait_healthy

PROMPT = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0}
KEY = "sk-api-servers-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ARGS = ("--api-server-count", "2", "--served-model-name", "tiny", "--max-model-len", "256",
        "--num-gpu-blocks-override", "256", "--liveness-timeout", "120", "--shutdown-timeout", "10",
        "--uvicorn-log-level", "info")


def api_processes(parent: int) -> list[int]:
    found = []
    for pid in child_pids(parent):
        with contextlib.suppress(OSError):
            if b"vllm_actors.server.api_process" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def wait_for(condition, what: str, log_path: Path, timeout: float = 120.0):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout:.0f} s\n{tail(log_path)}")


@contextlib.contextmanager
def parent_stopped(parent: int) -> Iterator[None]:
    os.kill(parent, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(parent, signal.SIGCONT)


def complete(base_url: str) -> str:
    response = httpx.post(f"{base_url}/v1/completions", json=PROMPT, headers=AUTH, timeout=120.0)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def started(log_path: Path, pid: int) -> bool:
    return f"Started server process [{pid}]" in log_path.read_text(errors="replace")


def test_a_second_api_process_serves_restarts_and_stops_with_the_parent(tiny_qwen3: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)  # the spec carries it: stdin, never a command line
    port, log_path = free_port(), tmp_path / "server.log"
    server = start_server(tiny_qwen3, port, log_path, tmp_path / "runs", *ARGS)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, server, log_path)
        (first,) = wait_for(lambda: api_processes(server.pid), "the second API process", log_path)
        wait_for(lambda: started(log_path, first), "the second API process serving", log_path)
        assert KEY.encode() not in Path(f"/proc/{first}/cmdline").read_bytes()
        expected = complete(base_url)
        with parent_stopped(server.pid):
            assert complete(base_url) == expected  # the second process answered alone
        metrics = httpx.get(f"{base_url}/metrics", headers=AUTH, timeout=30.0).text
        counts = re.findall(r"^vllm:e2e_request_latency_seconds_count\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
        assert counts == ["2.0"], counts  # both processes' requests, whichever process answers

        os.kill(first, signal.SIGKILL)
        (second,) = wait_for(lambda: [p for p in api_processes(server.pid) if p != first], "a restarted API process",
                             log_path)
        wait_for(lambda: started(log_path, second), "the restarted API process serving", log_path)
        with parent_stopped(server.pid):
            assert complete(base_url) == expected

        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, tail(log_path)
        wait_for(lambda: gone(second), "the API process gone after the parent's drain", log_path, timeout=30)
    finally:
        stop_process(server)


def test_the_api_process_of_a_sigkilled_parent_exits(tiny_qwen3: Path, tmp_path: Path) -> None:
    port, log_path = free_port(), tmp_path / "server.log"
    server = start_server(tiny_qwen3, port, log_path, tmp_path / "runs", *ARGS)
    left: list[int] = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, log_path)
        (api,) = wait_for(lambda: api_processes(server.pid), "the second API process", log_path)
        left = child_pids(server.pid)  # the API process and the group's actors
        server.kill()
        server.wait()
        for pid in left:
            wait_for(lambda pid=pid: gone(pid), f"process {pid} gone after its parent's SIGKILL", log_path,
                     timeout=60)
        assert api in left
    finally:
        stop_process(server)
        for pid in left:
            if not gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
