"""The timed borrowed-KV link for ``benchmarks/kv_borrow_exchange.py``: exclusive times of a call's
parts per thread (``PHASES``), the link module's host buffers, copies and messages wrapped to time them
(``instrument``), its lender share, server and staging subclassed to time theirs, and what the lender's
main thread does meanwhile (``Busy``)."""

from __future__ import annotations

import contextlib
import functools
import os
import select
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist

from vllm_actors.models import kv_borrow_link as link
from vllm_actors.models.kv_borrow import LenderShare
from vllm_actors.models.kv_borrow_link import LenderServer, QkvStaging

F = TypeVar("F", bound=Callable[..., Any])
PREP_ITERATIONS = 40_000  # a "prep" stretch of pure Python: ~1-2 ms on a 2020s core


class Phases:
    """Per thread, the exclusive time of named parts of the call in hand (a part's time leaves out
    the parts nested in it)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def _state(self) -> tuple[dict[str, float], list[float]]:
        local = self._local
        if not hasattr(local, "times"):
            local.times, local.stack = {}, []
        return local.times, local.stack

    def reset(self) -> None:
        times, stack = self._state()
        times.clear()
        stack.clear()

    def take(self) -> dict[str, float]:
        times, _ = self._state()
        taken = dict(times)
        times.clear()
        return taken

    @contextlib.contextmanager
    def timed(self, name: str) -> Iterator[None]:
        times, stack = self._state()
        stack.append(0.0)  # the nested parts' time
        start = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - start
            nested = stack.pop()
            times[name] = times.get(name, 0.0) + elapsed - nested
            if stack:
                stack[-1] += elapsed

    def wrap(self, name: str, fn: F) -> F:
        @functools.wraps(fn)
        def timed_call(*args: Any, **kwargs: Any) -> Any:
            with self.timed(name):
                return fn(*args, **kwargs)

        return cast(F, timed_call)


PHASES = Phases()


def sync(device: torch.device) -> None:
    """Wait for the current stream of ``device`` (nothing off CUDA)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class TimedDist:
    """``torch.distributed`` as the link module sees it, its sends and receives timed. On the lender
    the header's receive (float64) is ``recv_wait``: the thread idle until the home asks."""

    def __init__(self, role: str) -> None:
        self.role = role

    def send(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        with PHASES.timed("send"):
            return dist.send(tensor, *args, **kwargs)

    def recv(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.role == "home":
            name = "wait"
        else:
            name = "recv_wait" if tensor.dtype == torch.float64 else "recv"
        with PHASES.timed(name):
            return dist.recv(tensor, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)


def instrument(role: str) -> None:
    """Time the link module's host buffers, copies and messages in this process."""
    real_to_device = link.to_device

    def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        with PHASES.timed("h2d"):
            moved = real_to_device(host, device)
            sync(device)  # the copy is non-blocking: timed to its end
        return moved

    link.host_buffer = PHASES.wrap("alloc", link.host_buffer)
    link.to_host = PHASES.wrap("d2h", link.to_host)  # its own sync included
    link.to_device = to_device
    link.dist = TimedDist(role)  # type: ignore[assignment]


class TimedShare(LenderShare):
    """The lender's share, its ``attend`` timed to the call's return and then to its stream's sync."""

    def attend(self, layer: int, request_id: str, first: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               seq_len: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        with PHASES.timed("attend"):
            answer = super().attend(layer, request_id, first, q, k, v, seq_len, scale)
        with PHASES.timed("attend_sync"):
            sync(self.device)
        return answer


class TimedServer(LenderServer):
    """``LenderServer`` keeping each answered call's parts (seconds), ``total`` the whole call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.records: list[dict[str, float]] = []

    def serve_one(self) -> bool:
        PHASES.reset()
        start = time.perf_counter()
        more = super().serve_one()
        total = time.perf_counter() - start
        if more:
            record = PHASES.take()
            record["other"] = total - sum(record.values())
            record["answer"] = total - record.get("recv_wait", 0.0)
            record["total"] = total
            self.records.append(record)
        return more


class TimedStaging(QkvStaging):
    def packed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, float]:
        with PHASES.timed("pack"):
            return super().packed(q, k, v)


class Busy:
    """What the lender's main thread does while a thread of its own answers (``run_while``)."""

    def __init__(self, mode: str, device: torch.device, matmul: list[int], matmuls: int, dtype: torch.dtype) -> None:
        self.mode, self.device, self.matmuls = mode, device, matmuls
        if mode == "gpu":
            rows, hidden, inter = matmul
            self.x = torch.randn(rows, hidden, dtype=dtype, device=device)
            self.w = torch.randn(hidden, inter, dtype=dtype, device=device) * hidden ** -0.5
            self.y = torch.empty(rows, inter, dtype=dtype, device=device)

    def run_while(self, thread: threading.Thread) -> int:
        """Busy until ``thread`` ends; the loop's iterations (steps for ``gpu``)."""
        if self.mode == "none":
            thread.join()
            return 0
        read_end, write_end = os.pipe()  # never written: each look finds nothing, as an idle poll
        state: dict[str, float] = {"polls": 0.0, "last": time.monotonic()}
        iterations = 0
        try:
            while thread.is_alive():
                if self.mode == "gpu":
                    for _ in range(self.matmuls):  # a step's GEMMs on the main (default) stream
                        torch.matmul(self.x, self.w, out=self.y)
                    if self.device.type == "cuda":  # then the poll until the step is done
                        done = torch.cuda.Event()
                        done.record()
                        while not done.query() and thread.is_alive():
                            self._poll(read_end, state)
                elif self.mode == "prep":  # a step's preparation: pure Python that drops the GIL nowhere, then a look
                    total = 0
                    for i in range(PREP_ITERATIONS):
                        total += i
                    self._poll(read_end, state)
                else:
                    self._poll(read_end, state)
                iterations += 1
        finally:
            os.close(read_end)
            os.close(write_end)
        thread.join()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return iterations

    @staticmethod
    def _poll(fd: int, state: dict[str, float]) -> None:
        """The worker's busy poll: a zero-timeout look, its bookkeeping, ``time.sleep(0)``."""
        select.select([fd], [], [], 0)
        now = time.monotonic()
        state["polls"] += 1
        state["idle"] = now - state["last"]
        state["last"] = now
        time.sleep(0)
