"""Starting one actor process of a group: the devices a replica's worker sees, and the wait for its
READY line on its stdout pipe."""

from __future__ import annotations

import selectors
import time
from collections.abc import Callable, Mapping
from typing import Any

from vllm_actors.envs import Envs
from vllm_actors.protocol.names import WORKER
from vllm_actors.runtime.children import ActorStartError, Child, Stopping, status_line
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.recovery import POLL_INTERVAL


def replica_environment(spec: ActorSpec, environ: Mapping[str, str]) -> dict[str, str] | None:
    """A replica's worker sees only its own GPUs (data_parallel_size > 1): replica r of t workers
    (tensor x pipeline parallel size) gets the devices r*t .. r*t+t-1 of ``CUDA_VISIBLE_DEVICES`` (or of the
    machine's, numbered from 0). None: the supervisor's environment as it is."""
    if spec.role != WORKER or spec.replica is None:
        return None
    size = spec.engine.world_size
    visible = Envs(environ).CUDA_VISIBLE_DEVICES
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else None
    first = spec.replica * size
    chosen = devices[first:first + size] if devices is not None else [str(first + i) for i in range(size)]
    if devices is not None and len(chosen) < size:
        return None  # fewer devices than replicas (a CPU run, a shared GPU): leave it as it is
    return {**environ, "CUDA_VISIBLE_DEVICES": ",".join(chosen)}


def wait_ready(child: Child, siblings: list[Child] | None, timeout: float,
               stopping: Callable[[], bool]) -> dict[str, Any]:
    """Wait for the child's READY line (its info); raise ActorStartError if it fails, exits or
    takes longer than ``timeout`` seconds, or one of ``siblings`` (ranks starting with it, which
    it waits for) exits first; ``Stopping`` once ``stopping()`` says the group shuts down."""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(child.reader.fd, selectors.EVENT_READ)
        while True:
            for line in child.reader.lines():
                status = status_line(child, line)
                if status is None:
                    continue
                if status.get("status") == "ready":
                    return dict(status.get("info") or {})
                if status.get("status") == "alive":
                    continue
                error = status.get("error")
                raise ActorStartError(f"actor {child.actor_id} failed to start: {error}\n{child.log_tail()}")
            if child.reader.eof:
                child.process.wait(timeout=5)
                raise ActorStartError(
                    f"actor {child.actor_id} exited with code {child.process.returncode} before READY\n"
                    f"{child.log_tail()}"
                )
            gone = [s for s in siblings or [] if s is not child and s.process.poll() is not None]
            if gone:
                raise ActorStartError(
                    f"actor {gone[0].actor_id} exited with code {gone[0].process.returncode} while "
                    f"{child.actor_id} was starting\n{gone[0].log_tail()}"
                )
            if stopping():
                raise Stopping()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ActorStartError(
                    f"actor {child.actor_id} did not report READY within {timeout:.0f} s\n{child.log_tail()}"
                )
            if selector.select(min(remaining, POLL_INTERVAL)):
                child.reader.fill()
