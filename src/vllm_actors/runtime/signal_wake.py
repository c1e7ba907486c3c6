"""A socket that turns readable when the process gets a signal (``signal.set_wakeup_fd``): an actor's
loop polls it beside its zmq sockets, so a SIGTERM ends the loop at once. Without it the stop waited
for the poll's 100 ms timeout (the signal may land on a zmq I/O thread, and pyzmq resumes a poll that
one interrupted), once for the engine actors, the store and the bus in turn: 0.3 s of every stop."""

from __future__ import annotations

import signal
import socket

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


def wake_socket() -> socket.socket | None:
    """The socket to poll (None: not installed, as in the in-process engine)."""
    return _ends[0] if _ends is not None else None


def drain() -> None:
    """Read the wake-up bytes that arrived, so the next poll waits again."""
    if _ends is None:
        return
    try:
        while _ends[0].recv(4096):
            pass
    except (BlockingIOError, InterruptedError):
        pass
