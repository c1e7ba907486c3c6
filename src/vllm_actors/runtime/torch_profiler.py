"""vLLM's ``/start_profile`` and ``/stop_profile`` in the worker's shell: with
``VLLM_TORCH_PROFILER_DIR`` set, the worker is wrapped so that the two engine commands start
torch.profiler and, on stop, write the trace (``DIR/<actor>-<time>.json.gz``, a Chrome trace, and
its ``-top.txt`` table: ``step_profiler.Profiler``). The worker itself stays free of files."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from vllm_actors.envs import Envs
from vllm_actors.protocol.messages import ControlReply, EngineControl
from vllm_actors.protocol.names import SCHEDULER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.runtime.step_profiler import Profiler, WorkerWrapper

log = structlog.get_logger(__name__)


class TorchProfiledWorker(WorkerWrapper):
    """The worker, with the profiler's engine commands carried out here; every other message and
    attribute is the worker's own."""

    def __init__(self, worker: Any, directory: Path, label: str,
                 make_profiler: Callable[[], Any] = Profiler) -> None:
        self.worker = worker
        self.directory = directory
        self.label = label.replace("@", "-")
        self.make_profiler = make_profiler
        self.profiler: Any = None
        self.written: list[Path] = []

    def handle(self, message: Any) -> Outputs:
        if not isinstance(message, EngineControl) or message.action not in ("start_profile", "stop_profile"):
            return self.worker.handle(message)
        outputs = self.worker.flush()  # the step launched before belongs to what came before
        error = self._start() if message.action == "start_profile" else self._stop()
        if self.worker.tp.rank == 0:
            outputs.send(SCHEDULER, ControlReply(control_id=message.control_id, success=error is None, error=error))
        return outputs

    def _start(self) -> str | None:
        if self.profiler is not None:
            return None  # running already (vLLM starts it once too)
        self.profiler = self.make_profiler()
        self.profiler.start()
        log.info("torch profiler started", directory=str(self.directory))
        return None

    def _stop(self) -> str | None:
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            log.warning("stop_profile: the torch profiler was not started; nothing written")
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = self.directory / f"{self.label}-{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**6:06d}"
        try:
            self.written = profiler.stop(stem)
        except Exception as error:  # a trace that cannot be written never stops the engine
            log.warning("torch profile not written", error=f"{type(error).__name__}: {error}", path=str(stem))
            return f"the trace was not written: {type(error).__name__}: {error}"
        log.info("torch profile written", files=[str(path) for path in self.written])
        return None


def torch_profiled(worker: Any, settings: Envs, label: str) -> Any:
    """``worker`` wrapped when ``VLLM_TORCH_PROFILER_DIR`` is set, else as it is."""
    directory = settings.VLLM_TORCH_PROFILER_DIR
    return worker if not directory else TorchProfiledWorker(worker, Path(directory).expanduser(), label)
