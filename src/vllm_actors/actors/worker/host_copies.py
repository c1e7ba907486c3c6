"""Copies of a step's sampled ids to the host without waiting for the device.

A deferred step's ids stay on the device as the next step's inputs while their copy travels to
the host: two pinned buffers and two events used in turn (a step is read back before the step
after next reuses its buffer and event; creating an event per step is costly at batch 1). On a CPU
the copy is the tensor itself, ready at once.
"""

from __future__ import annotations

import torch


class HostCopies:
    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._turn = 0

    def start(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if chosen.device.type != "cuda":
            return chosen, None
        size = chosen.shape[0]
        self._turn ^= 1
        if len(self._buffers) < 2 or self._buffers[self._turn].shape[0] < size:
            capacity = max(size, 256)
            self._buffers = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(2)]
        host = self._buffers[self._turn][:size]
        host.copy_(chosen, non_blocking=True)
        if not self._events:
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        done = self._events[self._turn]
        done.record()
        return host, done
