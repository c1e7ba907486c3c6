"""Helpers for the server tests: free ports, a served process, a bus recorder, process checks."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import zmq

from vllm_actors.bench.procfs import child_pids as child_pids
from vllm_actors.bench.procfs import free_port as free_port  # the tests take it from here
from vllm_actors.protocol.events import EventBatch, Heartbeat, event_type


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


@contextlib.contextmanager
def served_url(model: Path, tmp: Path, *extra: str) -> Iterator[str]:
    """``vllm-actors serve`` on a free port with ``extra`` flags (its log and runs under ``tmp``):
    the base URL once it is healthy; the server stopped at the end."""
    port, log_path = free_port(), tmp / "server.log"
    process = start_server(model, port, log_path, tmp / "runs", *extra)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process, log_path)
        yield url
    finally:
        stop_process(process)


class BusRecorder:
    """Records every event batch on the bus, in a thread. With ``bus_in`` (the bus's publishing side)
    the constructor returns only once the subscription is live (``join_bus``): nothing the group
    publishes afterwards is missed."""

    def __init__(self, address: str, bus_in: str | None = None) -> None:
        self.batches: list[EventBatch] = []
        self._arrived = threading.Condition()
        self._stop = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)
        self._decoder = msgspec.msgpack.Decoder(EventBatch)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if bus_in is not None:
            join_bus(lambda: self.batches, bus_in)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._socket.poll(50):
                batch = self._decoder.decode(self._socket.recv_multipart()[-1])
                with self._arrived:
                    self.batches.append(batch)
                    self._arrived.notify_all()

    def events(self, kind: str, request_id: str | None = None) -> list[object]:
        return [e for b in list(self.batches) for e in b.events
                if event_type(e) == kind and (request_id is None or getattr(e, "request_id", None) == request_id)]

    def wait_for(self, kind: str, request_id: str, timeout: float = 60.0) -> object:
        """The first ``kind`` event of the request, as soon as it arrives (``timeout``: a safety net only)."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while not (found := self.events(kind, request_id)):
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"no {kind} event for {request_id} within {timeout} s"
                self._arrived.wait(remaining)
        return found[0]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._socket.close()


_probes = iter(range(1_000_000))


def join_bus(recorded: Callable[[], list[EventBatch]], bus_in: str, timeout: float = 60.0) -> str:
    """Wait until a bus subscriber's subscription is live: publish heartbeats from a probe actor of
    our own into the bus until the subscriber (``recorded()`` returns what it has received so far)
    has one. PUB/SUB drops whatever is published before the subscription reaches the bus (the
    slow-joiner problem); once our probe came through, everything published later reaches the
    subscriber too. The probe's batches stay in the recording, as an actor of their own; the
    metrics store lists the probe as one more actor, as it does a client's health probes.
    Returns the probe's actor id."""
    probe = f"probe-{os.getpid()}-{next(_probes)}"
    encoder = msgspec.msgpack.Encoder()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.connect(bus_in)
    deadline = time.monotonic() + timeout
    seq = 0
    try:
        while not any(batch.actor == probe for batch in list(recorded())):
            assert time.monotonic() < deadline, f"the subscriber saw none of {probe}'s events within {timeout} s"
            batch = EventBatch(actor=probe, first_seq=seq, mono=time.monotonic(), wall=time.time(),
                               events=[Heartbeat(pid=os.getpid())])
            publisher.send_multipart([probe.encode(), encoder.encode(batch)])
            seq += 1
            time.sleep(0.02)  # pacing between probes, not a wait for anything
    finally:
        publisher.close()
    return probe


def kill_when(ready: Callable[[], bool], pid: int, timeout: float = 120.0) -> tuple[threading.Thread, threading.Event]:
    """A started thread that SIGKILLs ``pid`` once ``ready()`` holds (polled), and the event it sets
    when it did: join the thread after the run, then assert the event (the kill happened under load)."""
    killed = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                os.kill(pid, signal.SIGKILL)
                killed.set()
                return
            time.sleep(0.02)

    killer = threading.Thread(target=watch, daemon=True)
    killer.start()
    return killer, killed
