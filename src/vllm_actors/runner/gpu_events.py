"""CUDA's timing events and clocks for the worker's GPU step timer (``actors/worker/gpu_timing.py``,
a pure state machine: the events, the synchronisation and the wall clock are injected from here)."""

from __future__ import annotations

import time

import torch

from vllm_actors.actors.worker.gpu_timing import EventSource, StepTimer, TimingEvent


def cuda_events(device: torch.device) -> EventSource:
    def new_event() -> TimingEvent:
        return torch.cuda.Event(enable_timing=True)  # type: ignore[return-value]

    return EventSource(new_event, lambda: torch.cuda.synchronize(device), time.time)


def step_timer(device: torch.device | None) -> StepTimer:
    """Enabled on a CUDA device; disabled elsewhere (a CPU step is done when launched)."""
    return StepTimer(cuda_events(device) if device is not None and device.type == "cuda" else None)
