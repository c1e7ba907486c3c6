"""Helpers for the server tests: free ports, a served process, a bus recorder, process checks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import zmq

from vllm_actors.protocol.events import EventBatch, event_type


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_healthy(base_url: str, process: subprocess.Popen[bytes], log_path: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{tail(log_path)}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the server did not become healthy within {timeout:.0f} s:\n{tail(log_path)}")


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def child_pids(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children.extend(int(c) for c in (task / "children").read_text().split())
        except OSError:
            continue
    return children


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def stop_process(process: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM, then SIGKILL (of the process and the children it left) if it lingers."""
    if process.poll() is None:
        children = child_pids(process.pid)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            for pid in children:
                if not gone(pid):
                    os.kill(pid, signal.SIGKILL)


def start_server(model: Path, port: int, log_path: Path, run_root: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, VLLM_ACTORS_RUN_ROOT=str(run_root))
    with open(log_path, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "vllm_actors", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--dtype", "float32", "--uvicorn-log-level", "warning", *extra],
            stdout=log_file, stderr=subprocess.STDOUT, env=env,
        )


class BusRecorder:
    """Records every event batch on the bus, in a thread."""

    def __init__(self, address: str) -> None:
        self.batches: list[EventBatch] = []
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._decoder = msgspec.msgpack.Decoder(EventBatch)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                self.batches.append(self._decoder.decode(self._socket.recv_multipart()[-1]))

    def events(self, kind: str, request_id: str | None = None) -> list[object]:
        return [e for b in list(self.batches) for e in b.events
                if event_type(e) == kind and (request_id is None or getattr(e, "request_id", None) == request_id)]

    def wait_for(self, kind: str, request_id: str, timeout: float = 15.0) -> object:
        deadline = time.monotonic() + timeout
        while True:
            found = self.events(kind, request_id)
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"no {kind} event for {request_id} within {timeout} s"
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()
