"""The extra API processes of ``vllm-actors serve --api-server-count N``, owned by the serving
parent (which serves as API process 0): started on the parent's listening socket, restarted when
one dies while serving (at most ``max_restarts`` in any ``restart_window`` seconds), drained with
the parent, killed at interpreter exit whatever happened (``weakref.finalize``).

Connections are shared out by the kernel: every process accepts on the one listening socket, so
a process whose event loop is busy takes fewer. A process that dies loses its open connections (as
a vLLM API server does). Its requests stop in the engine when its replacement comes up: each index
keeps one routing id at the scheduler, and a process that takes it over aborts what the dead one
left ("client restarted"). If the restart budget is spent they run on to their limits.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import msgspec
import structlog

from vllm_actors.runtime.supervision import RestartBudget
from vllm_actors.server.api_process import ApiProcessSpec
from vllm_actors.server.app_settings import AppSettings

log = structlog.get_logger(__name__)

READY_TIMEOUT = 120.0  # an API process loads the tokenizer and attaches to the group
POLL_SECONDS = 0.2
KILL_GRACE_SECONDS = 5.0  # after the drain's own timeout


@dataclass
class _Slot:
    index: int
    process: subprocess.Popen[bytes]


def _close_pipes(process: subprocess.Popen[bytes]) -> None:
    for pipe in (process.stdin, process.stdout):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:
                pass  # stdin of a dead process: its buffered bytes have nowhere to go


def _kill_all(slots: list[_Slot]) -> None:
    for slot in slots:
        if slot.process.poll() is None:
            slot.process.kill()
    for slot in slots:
        try:
            slot.process.wait(KILL_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        _close_pipes(slot.process)


class ApiServerPool:
    def __init__(self, settings: AppSettings, run_dir: str, listener: socket.socket, count: int,
                 metrics_dir: str, *, max_restarts: int = 5, restart_window: float = 60.0) -> None:
        """API processes 1..``count``-1 on ``listener`` (inheritable; the parent keeps serving on it)."""
        self.settings = settings
        self.run_dir = run_dir
        self.listener = listener
        self.count = count
        self.metrics_dir = metrics_dir
        self.budget = RestartBudget(max_restarts, restart_window, time.monotonic)
        self._slots: list[_Slot] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _kill_all, self._slots)
        self._identities = {index: f"client-api{index}-{os.getpid()}-{secrets.token_hex(4)}"
                            for index in range(1, count)}

    # ------------------------------------------------------------------ start
    def start(self) -> ApiServerPool:
        """Start every process and wait until each serves; on failure, kill what started and raise."""
        try:
            for index in range(1, self.count):
                self._slots.append(self._spawn(index))
            for slot in list(self._slots):
                self._await_ready(slot)
        except BaseException:
            self._finalizer()
            raise
        self._monitor = threading.Thread(target=self._watch, name="api-pool-monitor", daemon=True)
        self._monitor.start()
        log.info("API processes serving", count=self.count, pids=self.pids())
        return self

    def _spawn(self, index: int) -> _Slot:
        spec = ApiProcessSpec(index=index, run_dir=self.run_dir, listen_fd=self.listener.fileno(),
                              metrics_dir=self.metrics_dir, identity=self._identities[index], settings=self.settings)
        process = subprocess.Popen(
            [sys.executable, "-m", "vllm_actors.server.api_process", f"--index={index}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=[self.listener.fileno()],
            start_new_session=True,
        )
        assert process.stdin is not None
        try:
            process.stdin.write(msgspec.json.encode(spec) + b"\n")  # the spec holds the API keys: not in argv
            process.stdin.flush()
        except BrokenPipeError:
            pass  # it died at once: _await_ready reports its exit status
        return _Slot(index, process)

    def _await_ready(self, slot: _Slot) -> None:
        assert slot.process.stdout is not None
        stdout = slot.process.stdout
        deadline = time.monotonic() + READY_TIMEOUT
        ready = threading.Event()

        def read() -> None:
            if stdout.readline().strip() == b"ready":
                ready.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while not ready.is_set():
            if slot.process.poll() is not None:
                raise RuntimeError(f"API process {slot.index} exited with status {slot.process.returncode} "
                                   "before serving (its log is above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"API process {slot.index} did not serve within {READY_TIMEOUT:.0f} s")
            ready.wait(POLL_SECONDS)

    # ------------------------------------------------------------------ supervise
    def _watch(self) -> None:
        while not self._stopping.wait(POLL_SECONDS):
            for position, slot in enumerate(list(self._slots)):
                status = slot.process.poll()
                if status is None or self._stopping.is_set():
                    continue
                self._restart(position, slot, status)

    def _restart(self, position: int, slot: _Slot, status: int) -> None:
        if not self.budget.try_spend():
            log.error("API process died; restart budget spent: serving on with fewer", index=slot.index,
                      status=status, max_restarts=self.budget.max_restarts, window=self.budget.window)
            with self._lock:
                self._slots.remove(slot)
            _close_pipes(slot.process)
            return
        log.error("API process died: restarting it", index=slot.index, status=status)
        _close_pipes(slot.process)
        try:
            replacement = self._spawn(slot.index)
            with self._lock:
                self._slots[position] = replacement
            self._await_ready(replacement)
        except (OSError, RuntimeError, TimeoutError) as error:
            log.error("API process did not come back", index=slot.index, error=str(error))

    def pids(self) -> list[int]:
        with self._lock:
            return [slot.process.pid for slot in self._slots]

    # ------------------------------------------------------------------ stop
    def drain(self) -> None:
        """Every process stops taking requests and finishes its running ones (SIGTERM); nothing
        is restarted from now on."""
        self._stopping.set()
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            if slot.process.poll() is None:
                try:
                    os.kill(slot.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def stop(self, timeout: float) -> None:
        """Drain, wait up to ``timeout`` seconds for every process to end, then kill the rest."""
        self.drain()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(POLL_SECONDS * 5)
        deadline = time.monotonic() + timeout
        for slot in list(self._slots):
            try:
                slot.process.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                log.warning("API process still running after the drain: killing it", index=slot.index)
        self._finalizer()
