"""TCP ports held for a process group from the moment its addresses are chosen until it stops.

A port found free by binding and closing a probe can be taken by anyone before the actor binds it
(CI at 1a55c8c: a Ray host's KV-cache manager found its port in use). A ``PortReservation`` keeps
each probe bound instead, with ``SO_REUSEADDR`` set only after the bind: a probe of another group
(bound without it) is refused, an outgoing connection never picks a bound port, and the actor's
own ZeroMQ socket (which sets ``SO_REUSEADDR``) binds over the idle probe - also when it restarts.
"""

from __future__ import annotations

import socket
import weakref


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()
    sockets.clear()


class PortReservation:
    """TCP ports on ``host``, each held from ``take()`` until ``close()`` (or garbage collection,
    or interpreter exit)."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._sockets: list[socket.socket] = []
        self._finalizer = weakref.finalize(self, _close_all, self._sockets)

    def take(self, count: int) -> list[int]:
        """``count`` more ports, distinct from each other and from every port held anywhere."""
        if self.closed:
            raise RuntimeError("the port reservation is closed")
        ports = []
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sockets.append(sock)
            sock.bind((self.host, 0))  # without SO_REUSEADDR: fails on a port anyone holds
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ports.append(int(sock.getsockname()[1]))
        return ports

    @property
    def ports(self) -> list[int]:
        return [int(sock.getsockname()[1]) for sock in self._sockets]

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive
