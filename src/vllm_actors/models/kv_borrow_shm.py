"""Shared memory between the replicas of one host for borrowed KV's exchange (``kv_borrow_link``):
a home's requests (q, k and v of a guest's layer, packed) in a region the home writes and its lenders
read, and each lender's replies to a home (output and LSE) in a region it writes and the home reads.
The gloo group then carries only the headers, the doorbells: a guest's layer of 4,096 tokens of the
8B shape sends 48 MiB of q, k and v and gets 64 MiB back, which TCP over loopback moved at ~3.4 GB/s
here (``benchmarks/kv_borrow_exchange.py``: 47 ms a layer on the CPU, before any device copy).

A region is a file under ``/dev/shm`` (the system's temporary folder where there is none) mapped
shared by ``torch.from_file``: its writer creates it at its first use, sized for ``capacity`` tokens
of the call (the step's token budget); its reader maps it by name when a header first says the data is
there. On a GPU the mapping is registered with CUDA (``cudaHostRegister``), so that the copies to and
from the device are the pinned kind, asynchronous on the stream; where registration fails, they are
plain copies (correct, slower). A call with more tokens than the region holds travels over gloo as
before. The writer removes the file when its region is closed or collected, or at exit
(``weakref.finalize``); a mapping outlives the file's name. The supervisor removes what a killed
worker left (``runtime/shm_regions.py``).

Order: a home writes its request region only after every lender asked before has answered (their
replies mean they have read it: a lender's reply is sent after its copies of the request are done), and
a lender writes its reply region for a home only when that home asks again, which it does after its
stream is synchronised (``QkvStaging``), so after the previous reply's copy to the device has run.
"""

from __future__ import annotations

import math
import os
import weakref
from pathlib import Path

import structlog
import torch

from vllm_actors.runtime.shm_regions import SHM_FOLDER

log = structlog.get_logger(__name__)
# ROOM: a region's pages are allocated when it is created (``posix_fallocate``): a /dev/shm too small for it (a
# container's default is 64 MB) is an OSError there, and the exchange stays on gloo, rather than a SIGBUS at the
# first write past the room.


def request_name(prefix: str, home: int) -> str:
    return f"{prefix}-q{home}"


def reply_name(prefix: str, home: int, lender: int) -> str:
    return f"{prefix}-r{home}-{lender}"


def _pin(tensor: torch.Tensor) -> bool:
    """Registers the mapping with CUDA (its copies then run as from pinned memory); False where it fails."""
    try:
        error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    except (RuntimeError, AttributeError, TypeError) as exc:
        log.warning("kv_borrow_shm_unpinned", error=repr(exc))
        return False
    if int(error) != 0:
        log.warning("kv_borrow_shm_unpinned", error=int(error))
        return False
    return True


def _release(path: Path | None, pinned_ptr: int) -> None:
    """The region's end: unregistered from CUDA, its file removed by its writer (``path``)."""
    if pinned_ptr:
        try:
            torch.cuda.cudart().cudaHostUnregister(pinned_ptr)
        except (RuntimeError, AttributeError, TypeError):
            pass  # at exit CUDA may be gone: the process's end releases it
    if path is not None:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


class ShmRegion:
    """One region: ``create`` by its writer (``nbytes``), else mapped by its reader (the file's size)."""

    def __init__(self, name: str, device: torch.device, *, nbytes: int = 0, create: bool = False) -> None:
        self.name = name
        self.path = SHM_FOLDER / name
        if create:  # a fresh file of the size asked (a stale one replaced), its pages allocated now: see ROOM
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)
                else:  # not Linux: a sparse file, no room check
                    os.ftruncate(fd, nbytes)
            except OSError:
                self.path.unlink(missing_ok=True)
                raise
            finally:
                os.close(fd)
        try:
            self.nbytes = os.path.getsize(self.path)
            self.tensor = torch.from_file(str(self.path), shared=True, size=self.nbytes, dtype=torch.uint8)
        except BaseException:
            if create:  # made halfway: its file goes
                self.path.unlink(missing_ok=True)
            raise
        self.pinned = device.type == "cuda" and _pin(self.tensor)
        self._finalizer = weakref.finalize(self, _release, self.path if create else None,
                                           self.tensor.data_ptr() if self.pinned else 0)

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        return nbytes_of(shape, dtype) <= self.nbytes

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The region's first bytes as a tensor of ``shape`` (writes land in the region)."""
        return self.tensor[:nbytes_of(shape, dtype)].view(dtype).view(shape)

    def close(self) -> None:
        self._finalizer()


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """The bytes of a tensor of ``shape`` and ``dtype``."""
    return math.prod(shape) * dtype.itemsize
