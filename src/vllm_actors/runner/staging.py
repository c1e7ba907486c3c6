"""Pinned host staging buffers that the host never refills while the device may still copy from them.

A ``copy_(..., non_blocking=True)`` out of pinned memory is only enqueued: the device reads the
host bytes when it reaches the copy. A step's inputs go through two sets of buffers used in turn,
so the host can fill step N+1 while step N's copies are queued; if the host ran further ahead, it
would rewrite a set whose copy has not run yet, and that step would read a later step's inputs.
``StagingSets`` makes that impossible for every caller: on a GPU it records an event after a
set's copies are enqueued (``enqueued``) and waits for it before handing the set out again
(``acquire``). The wait costs nothing while the device is at most one step behind; it blocks the
host only where it would otherwise corrupt inputs. On a CPU the copies are done when they return:
nothing is recorded or waited on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

T = TypeVar("T")


class Fence(Protocol):
    """What a set's copies are fenced with: a CUDA event on the device's current stream (tests: a fake)."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class CudaFence:
    """A CUDA event recorded on ``device``'s current stream (the stream the copies were enqueued on)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self._device))

    def synchronize(self) -> None:
        self._event.synchronize()


class StagingSets(Generic[T]):
    """Sets of host buffers (any ``T``: a tensor, a dict of views; two by default) handed out in turn.

    ``acquire()`` takes the next set, once every copy enqueued out of its previous use has run;
    the caller fills it, enqueues its copies, then calls ``enqueued()``. A caller that takes the
    next set without calling ``enqueued()`` gets the fence recorded then (later: the same safety,
    a longer wait)."""

    def __init__(self, make: Callable[[], T], device: torch.device,
                 fence: Callable[[], Fence] | None = None, count: int = 2) -> None:
        """``make``: builds one set; ``fence``: builds a set's fence (default: a CUDA event on a
        GPU, none on a CPU); ``count``: how many sets take turns."""
        if count < 1:
            raise ValueError(f"a staging owner needs at least one set, got count={count}")
        self._sets = [make() for _ in range(count)]
        self._new_fence = fence if fence is not None else \
            (lambda: CudaFence(device)) if device.type == "cuda" else None
        self._fences: list[Fence | None] = [None] * count
        self._pending = [False] * count  # a set's fence recorded since it was last handed out
        self._turn = count - 1  # the first acquire hands out set 0
        self._in_use = False

    def acquire(self) -> T:
        """The next set, free to be rewritten: its previous copies have run on the device."""
        if self._in_use and not self._pending[self._turn]:
            self.enqueued()  # the caller did not say: everything enqueued so far covers its copies
        self._turn = (self._turn + 1) % len(self._sets)
        fence = self._fences[self._turn]
        if self._pending[self._turn] and fence is not None:
            fence.synchronize()
        self._pending[self._turn] = False
        self._in_use = True
        return self._sets[self._turn]

    def replace(self, new: T) -> T:
        """The set just acquired replaced (grown) by ``new``; returns it."""
        self._sets[self._turn] = new
        return new

    def enqueued(self) -> None:
        """Every copy out of the set just acquired is enqueued: fence it (on a GPU)."""
        if self._new_fence is None:
            return
        fence = self._fences[self._turn]
        if fence is None:
            fence = self._fences[self._turn] = self._new_fence()
        fence.record()
        self._pending[self._turn] = True
