"""Engine commands at the worker (``EngineControl`` passed on by the KV-cache manager): sleep and
wake-up, carried out by the runner where it can (``Sleeper``); the profiler's are the shell's
(``runtime/torch_profiler.py``), and a worker without one answers that none is configured."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from vllm_actors.protocol.messages import EngineControl

NO_PROFILER = "the torch profiler is not configured (set VLLM_TORCH_PROFILER_DIR)"


@runtime_checkable
class Sleeper(Protocol):
    """A runner that frees its device memory on ``sleep`` and restores it on ``wake_up``
    (``runner.model_runner.ModelRunner``)."""

    @property
    def is_sleeping(self) -> bool: ...

    def sleep(self, level: int) -> None:
        """Level 1: weights to host memory, KV cache freed; level 2: both freed."""
        ...

    def wake_up(self, tags: list[str]) -> None:
        """Restore ``tags`` ("weights", "kv_cache"); the KV cache comes back empty."""
        ...


def carry_out(runner: object, control: EngineControl) -> str | None:
    """Apply ``control`` to ``runner``; the error its sender gets (None: done)."""
    if control.action in ("start_profile", "stop_profile"):
        return NO_PROFILER
    if control.action not in ("sleep", "wake_up"):
        return f"{control.action}: not a worker's command"
    if not isinstance(runner, Sleeper):
        return f"{control.action}: this worker's runner has no sleep mode"
    if control.action == "sleep":
        runner.sleep(control.level)
    else:
        runner.wake_up(list(control.tags) if control.tags is not None else ["weights", "kv_cache"])
    return None
