"""The host KV tier's memory as the supervisor owns it, so that it outlives a worker: one anonymous
shared-memory file (``memfd``) per worker rank, inherited by each start of that rank's process.

A worker maps its file as its host tier (``runner/host_kv_tier.py``, which sizes it); a restarted
worker maps the same file and finds the blocks the KV-cache manager's bookkeeping says are there.
The file has no name, so nothing can leak: the memory goes once the supervisor has closed its
descriptors and every worker mapping it has exited, even after a SIGKILL of the supervisor. This
object owns the descriptors and closes them on ``close()``, on garbage collection, at interpreter
exit, and when making one fails halfway (``weakref.finalize``).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping

FD_VARIABLE = "VLLM_ACTORS_KV_OFFLOAD_FD"  # the setting a worker reads (``envs``)


def _close(fds: dict[str, int]) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class HostKvMemory:
    """One memfd per worker actor id, made on first use."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._finalizer = weakref.finalize(self, _close, self._fds)

    def fd_for(self, actor_id: str) -> int:
        if not self._finalizer.alive:
            raise RuntimeError("the host KV tier's memory was closed")
        fd = self._fds.get(actor_id)
        if fd is None:
            fd = self._fds[actor_id] = os.memfd_create(f"vllm-actors-kv-{actor_id}", os.MFD_CLOEXEC)
        return fd

    def environment(self, actor_id: str, environ: Mapping[str, str]) -> dict[str, str]:
        """``environ`` with the descriptor the worker inherits (``Popen(pass_fds=...)``)."""
        return {**environ, FD_VARIABLE: str(self.fd_for(actor_id))}

    def close(self) -> None:
        self._finalizer()
