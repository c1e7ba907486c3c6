"""A torch profile of a window of engine steps, written by every worker: each tensor-parallel rank
and each replica its own file, so a slow rank or a collective that waits shows side by side.

    VLLM_ACTORS_PROFILE_STEPS=FIRST:COUNT   profile COUNT step plans, from the first whose step id
                                            is at least FIRST (ids count from 0 per scheduler)
    VLLM_ACTORS_PROFILE_DIR=DIR             where (default ``vllm-actors-profiles``)

Each worker writes ``DIR/<actor>-steps-<first>-<last>.json.gz`` (a Chrome trace: open it in
ui.perfetto.dev) and ``...-top.txt``: the device timeline (``profile_timeline``: steps back to
back, or the GPU idle between them), then torch's table of operators and kernels by device time
(by CPU time without a GPU). The wrapper sits in the shell, around the worker: the worker itself
stays free of clocks and files. vLLM's equivalent is ``VLLM_TORCH_PROFILER_DIR`` with
``start_profile``/``stop_profile``; a window of step ids needs no call from the client and lands on
the same steps in every rank.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.envs import Envs
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.runtime.profile_timeline import device_bursts, format_bursts, format_marginals, marginal_times

log = structlog.get_logger(__name__)

_STEP_BITS = 40  # a restarted scheduler numbers its steps from incarnation << 40 (Scheduler)


@dataclass(frozen=True)
class ProfileWindow:
    first: int
    count: int
    directory: Path

    @classmethod
    def from_env(cls, settings: Envs | Mapping[str, str]) -> ProfileWindow | None:
        """The window ``VLLM_ACTORS_PROFILE_STEPS`` asks for (None: none), from the registry or a mapping."""
        settings = settings if isinstance(settings, Envs) else Envs(settings)
        steps = settings.VLLM_ACTORS_PROFILE_STEPS
        if steps is None:
            return None
        return cls(steps[0], steps[1], Path(settings.VLLM_ACTORS_PROFILE_DIR))


class Profiler:
    """torch.profiler over CPU and, where there is one, CUDA activity."""

    def __init__(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(activities=activities, record_shapes=True)

    def start(self) -> None:
        self.profile.start()

    def stop(self, stem: Path) -> list[Path]:
        import torch

        if self.cuda:  # the window's last kernels, launched before its end, are in the trace
            torch.cuda.synchronize()
        self.profile.stop()
        trace = stem.with_name(stem.name + ".json.gz")
        self.profile.export_chrome_trace(str(trace))
        table = stem.with_name(stem.name + "-top.txt")
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        with gzip.open(trace, "rt") as file:  # the device timeline: steps back to back, or idle between them
            events = json.load(file).get("traceEvents", [])
        table.write_text(format_bursts(device_bursts(events)) + "\n" + format_marginals(marginal_times(events)) + "\n"
                         + self.profile.key_averages().table(sort_by=sort, row_limit=40) + "\n")
        return [trace, table]


class WorkerWrapper:
    """A shell's wrapper around the worker: every attribute is the worker's own."""

    worker: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)

    # The worker's deferred steps (``transport.Deferring``), declared here so the loop sees them.
    def has_pending(self) -> bool:
        return bool(self.worker.has_pending())

    def pending_ready(self) -> bool:
        return bool(self.worker.pending_ready())

    def flush(self) -> Outputs:
        return self.worker.flush()


class ProfiledWorker(WorkerWrapper):
    """The worker, with its plans from ``window.first`` to ``first + count - 1`` profiled; every
    other attribute is the worker's own."""

    def __init__(self, worker: Any, window: ProfileWindow, label: str,
                 make_profiler: Callable[[], Any] = Profiler) -> None:
        self.worker = worker
        self.window = window
        self.label = re.sub(r"[^A-Za-z0-9_.-]+", "_", label)
        self.make_profiler = make_profiler
        self.profiler: Any = None
        self.seen = 0
        self.first_step: int | None = None
        self.done = False
        self.written: list[Path] = []

    def handle(self, message: Any) -> Outputs:
        plan = message if isinstance(message, StepPlan) else None
        if plan is not None and not self.done and self.profiler is None \
                and plan.step_id & ((1 << _STEP_BITS) - 1) >= self.window.first:
            self.profiler = self.make_profiler()
            self.profiler.start()
            self.first_step = plan.step_id
        outputs = self.worker.handle(message)
        if plan is not None and self.profiler is not None:
            self.seen += 1
            if self.seen >= self.window.count:
                self._finish(plan.step_id)
        return outputs

    def _finish(self, last_step: int) -> None:
        profiler, self.profiler, self.done = self.profiler, None, True
        self.window.directory.mkdir(parents=True, exist_ok=True)
        stem = self.window.directory / f"{self.label}-steps-{self.first_step}-{last_step}"
        try:
            self.written = profiler.stop(stem)
        except Exception as error:  # a profile that cannot be written never stops the engine
            log.warning("step profile not written", error=f"{type(error).__name__}: {error}", path=str(stem))
            return
        log.info("step profile written", files=[str(path) for path in self.written])


def profiled(worker: Any, settings: Envs | Mapping[str, str], label: str) -> Any:
    """``worker`` wrapped when ``VLLM_ACTORS_PROFILE_STEPS`` asks for a window, else as it is."""
    window = ProfileWindow.from_env(settings)
    return worker if window is None else ProfiledWorker(worker, window, label)
