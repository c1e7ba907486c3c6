"""Engine commands at the scheduler (``EngineControl``: vLLM's ``/sleep``, ``/wake_up``,
``/is_sleeping``, ``/reset_prefix_cache`` and the profiler's): their checks and the sleep state.

Sleep as vLLM 0.26 defines it: level 0 pauses scheduling; levels 1 and 2 pause it and put the
workers' weights (offloaded to host memory at 1, discarded at 2) and KV cache (discarded) to
sleep. New requests wait while paused. ``wake_up`` wakes the tags it names (all by default);
scheduling resumes once nothing sleeps in the workers any more.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_actors.protocol.events import SleepChanged
from vllm_actors.protocol.messages import CONTROL_ACTIONS, SLEEP_MODES, WAKE_TAGS, ControlReply, EngineControl

WORKER_TAGS = frozenset({"weights", "kv_cache"})  # what sleeps in the workers at levels 1 and 2


def control_error(control: EngineControl) -> str | None:
    """What is wrong with a command (None: nothing), in the words a client can act on."""
    if control.action not in CONTROL_ACTIONS:
        return f"action: must be one of {', '.join(CONTROL_ACTIONS)}, got {control.action!r}"
    if control.action == "sleep":
        if control.level not in (0, 1, 2):
            return f"level: must be 0, 1 or 2, got {control.level}"
        if control.mode not in SLEEP_MODES:
            return f"mode: must be one of {', '.join(SLEEP_MODES)}, got {control.mode!r}"
    if control.action == "wake_up" and control.tags is not None:
        unknown = [tag for tag in control.tags if tag not in WAKE_TAGS]
        if unknown:
            return f"tags: each must be one of {', '.join(WAKE_TAGS)}, got {unknown[0]!r}"
    return None


@dataclass
class SleepState:
    paused: bool = False  # nothing is planned; new requests wait
    asleep: set[str] = field(default_factory=set)  # what sleeps in the workers
    pending: EngineControl | None = None  # a sleep of mode "wait": once nothing runs; nothing is admitted
    level: int = 0  # the level of the sleep while anything sleeps in the workers

    @property
    def is_sleeping(self) -> bool:
        return self.paused or bool(self.asleep) or self.pending is not None

    @property
    def admitting(self) -> bool:
        return not self.paused and self.pending is None

    def wake(self, tags: list[str] | None) -> list[str]:
        """Wake ``tags`` (None: all); the worker tags that wake now, in ``WAKE_TAGS`` order."""
        chosen = set(WAKE_TAGS if tags is None else tags)
        waking = [tag for tag in WAKE_TAGS if tag in self.asleep and tag in chosen]
        self.asleep -= chosen
        if not self.asleep:
            self.level = 0
            if self.pending is None:
                self.paused = False
        return waking

    def event(self) -> SleepChanged:
        """The state as published (vLLM's vllm:engine_sleep_state reads it)."""
        return SleepChanged(sleeping=self.is_sleeping, level=self.level)

    def reply(self, control: EngineControl, success: bool = True, error: str | None = None) -> ControlReply:
        return ControlReply(control_id=control.control_id, success=success and error is None,
                            is_sleeping=self.is_sleeping, error=error)
