"""A socket that turns readable when the process gets a signal (``signal.set_wakeup_fd``): an actor's
loop polls it beside its zmq sockets, so a SIGTERM ends the loop at once. Without it the stop waited
for the poll's 100 ms timeout (the signal may land on a zmq I/O thread, and pyzmq resumes a poll that
one interrupted), once for the engine actors, the store and the bus in turn: 0.3 s of every stop."""

from __future__ import annotations

import signal
import socket
from collections.abc import Mapping
from typing import Any

import zmq

_ends: tuple[socket.socket, socket.socket] | None = None  # (read, write); the write end is the wakeup fd


def install() -> None:
    """Route every signal's wake-up byte to the socket (main thread only; once per process)."""
    global _ends
    if _ends is not None:
        return
    read, write = socket.socketpair()
    read.setblocking(False)
    write.setblocking(False)
    signal.set_wakeup_fd(write.fileno(), warn_on_full_buffer=False)
    _ends = (read, write)


def watch(poller: zmq.Poller) -> None:
    """Poll the wake-up socket with ``poller``'s sockets (nothing where it is not installed, as in the
    in-process engine); a poll that saw it then passes its result through ``woke``."""
    if _ends is not None:
        poller.register(_ends[0], zmq.POLLIN)


def woke(ready: Mapping[Any, int]) -> bool:
    """Whether a poll's ``ready`` holds the wake-up socket; if so its bytes are read, so the next poll
    waits again."""
    if _ends is None or _ends[0] not in ready:
        return False
    try:
        while _ends[0].recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass
    return True
