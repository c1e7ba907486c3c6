"""The supervisor: starts the actors of one group as OS processes, in order, and stops them.

Order: the event bus, the metrics store, the worker(s), the KV-cache manager, the scheduler. The
workers come before the KV-cache manager and the scheduler (the design sketch lists them last)
because the size of the KV pool is known only once a worker has loaded the model and measured
the memory left; the scheduler comes last because it is the group's entry point.

Each child is a fresh interpreter (``python -m vllm_actors.runtime.actor_main``), so a user's unguarded
``__main__`` is never imported again. Each reports READY on its stdout pipe (only once the metrics
store has seen its events) and watches its stdin pipe: when the supervisor dies, even by SIGKILL,
the pipe closes and the child exits. One object owns the processes, pipes and the run directory;
its cleanup runs on ``shutdown()``, on garbage collection, at interpreter exit, and when start-up
fails halfway.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import msgspec
import structlog

from vllm_actors.protocol.config import (
    EngineConfig,
    SchedulerConfig,
    resolve_scheduler_config,
)
from vllm_actors.protocol.names import worker_id
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.run_dir import (
    GroupAddresses,
    GroupInfo,
    make_addresses,
    make_run_dir,
    write_group_info,
)

log = structlog.get_logger(__name__)

STOP_GRACE_SECONDS = 5.0


class ActorStartError(RuntimeError):
    """An actor did not come up: names the actor and why, with the end of its log."""


class ActorDiedError(RuntimeError):
    """An actor of a running group exited: names the actor, with the end of its log."""


@dataclass
class Child:
    actor_id: str
    role: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def _cleanup(children: list[Child], run_dir: Path, grace: float) -> None:
    """Stop every child (newest first), then remove the run directory. Idempotent."""
    for child in reversed(children):
        if child.process.poll() is None:
            try:
                child.process.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for child in reversed(children):
        remaining = max(deadline - time.monotonic(), 0.0)
        try:
            child.process.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
        for pipe in (child.process.stdin, child.process.stdout):
            if pipe is not None:
                pipe.close()
    children.clear()
    shutil.rmtree(run_dir, ignore_errors=True)


class ProcessGroup:
    def __init__(
        self,
        config: EngineConfig,
        *,
        tcp_host: str | None = None,
        start_timeout: float = 300.0,
        check_invariants: bool = False,
        metrics_max_events: int = 100_000,
        log_dir: str | None = None,
    ) -> None:
        self.config = config
        self.start_timeout = start_timeout
        self.check_invariants = check_invariants
        self.metrics_max_events = metrics_max_events
        self.run_dir = make_run_dir()
        self.log_dir = Path(log_dir) if log_dir else self.run_dir
        self.addresses: GroupAddresses = make_addresses(self.run_dir, config.tensor_parallel_size, tcp_host)
        self.children: list[Child] = []
        self.worker_info: dict[str, Any] = {}
        self.scheduler_config: SchedulerConfig | None = None
        self._finalizer = weakref.finalize(self, _cleanup, self.children, self.run_dir, STOP_GRACE_SECONDS)

    # ------------------------------------------------------------------ start
    def start(self) -> ProcessGroup:
        try:
            self._start_child("bus", "bus")
            self._start_child("metrics", "metrics")
            for rank in range(self.config.tensor_parallel_size):
                self.worker_info = self._start_child("worker", worker_id(rank), rank=rank)
            num_blocks = int(self.worker_info["num_blocks"])
            self.scheduler_config = resolve_scheduler_config(
                self.config, int(self.worker_info["max_position_embeddings"]), num_blocks
            )
            self._start_child("kv_cache_manager", "kv_cache_manager", num_blocks=num_blocks)
            self._start_child("scheduler", "scheduler", scheduler=self.scheduler_config, num_blocks=num_blocks)
        except BaseException:
            self.shutdown()
            raise
        write_group_info(self.info)
        log.info("group started", run_dir=str(self.run_dir), actors=[c.actor_id for c in self.children])
        return self

    @property
    def info(self) -> GroupInfo:
        return GroupInfo(
            pid=os.getpid(),
            run_dir=str(self.run_dir),
            model=self.config.model,
            addresses=self.addresses,
            worker=self.worker_info,
            max_model_len=self.scheduler_config.max_model_len if self.scheduler_config else 0,
            tokenizer=None if self.config.skip_tokenizer_init else (self.config.tokenizer or self.config.model),
        )

    def _start_child(self, role: str, actor_id: str, **spec_fields: Any) -> dict[str, Any]:
        spec = ActorSpec(
            role=role,
            actor_id=actor_id,
            addresses=self.addresses,
            engine=self.config,
            check_invariants=self.check_invariants,
            metrics_max_events=self.metrics_max_events,
            **spec_fields,
        )
        log_path = self.log_dir / f"{actor_id}.log"
        with open(log_path, "ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "vllm_actors.runtime.actor_main", msgspec.json.encode(spec).decode()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                start_new_session=True,  # a terminal's Ctrl-C reaches the supervisor, which stops us
                close_fds=True,
            )
        child = Child(actor_id, role, process, log_path)
        self.children.append(child)
        return self._await_ready(child)

    def _await_ready(self, child: Child) -> dict[str, Any]:
        stdout: IO[bytes] = child.process.stdout  # type: ignore[assignment]
        deadline = time.monotonic() + self.start_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ActorStartError(
                    f"actor {child.actor_id} did not report READY within {self.start_timeout:.0f} s\n{child.log_tail()}"
                )
            readable, _, _ = select.select([stdout], [], [], min(remaining, 0.5))
            if readable:
                line = stdout.readline()
                if not line:
                    child.process.wait(timeout=5)
                    raise ActorStartError(
                        f"actor {child.actor_id} exited with code {child.process.returncode} before READY\n"
                        f"{child.log_tail()}"
                    )
                status = json.loads(line)
                if status.get("status") == "ready":
                    return dict(status.get("info") or {})
                error = status.get("error")
                raise ActorStartError(f"actor {child.actor_id} failed to start: {error}\n{child.log_tail()}")

    # ------------------------------------------------------------------ state
    def alive(self) -> dict[str, bool]:
        return {child.actor_id: child.process.poll() is None for child in self.children}

    def raise_if_dead(self) -> None:
        """Raise ActorDiedError, with the end of its log, when an actor of the group has exited."""
        for child in self.children:
            if child.process.poll() is not None:
                raise ActorDiedError(
                    f"actor {child.actor_id} exited with code {child.process.returncode}\n{child.log_tail()}"
                )

    def pids(self) -> dict[str, int]:
        return {child.actor_id: child.process.pid for child in self.children}

    # ------------------------------------------------------------------ stop
    def shutdown(self) -> None:
        self._finalizer()

    @property
    def stopped(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> ProcessGroup:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
