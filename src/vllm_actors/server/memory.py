"""Hand memory back to the system after a large request.

Tokenising a large text grows the heap, and freeing everything leaves it grown: glibc keeps freed
heap pages (and raises its mmap threshold after a large block is freed, so later large blocks land
on the heap too). ``malloc_trim(0)`` gives them back. The server calls it, on a thread (ctypes
drops the GIL), once a request whose body was large has been answered.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable

import structlog
from starlette.types import ASGIApp, Receive, Scope, Send

log = structlog.get_logger(__name__)

LARGE_BODY_BYTES = 1024 * 1024  # a request with a body this large is followed by a trim


def _load_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim: Callable[[int], int] = libc.malloc_trim  # glibc only
    except (OSError, AttributeError, TypeError):
        return None
    return trim


_malloc_trim = _load_malloc_trim()


def trim_memory() -> bool:
    """Return the allocator's free memory to the system (glibc); False where there is no such call."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True


class TrimAfterLargeBodies:
    """ASGI middleware: after a request whose Content-Length is at least ``threshold`` (or a chunked
    body, whose size is unknown) has been answered, trim the heap (one trim at a time)."""

    def __init__(self, app: ASGIApp, threshold: int = LARGE_BODY_BYTES) -> None:
        self.app = app
        self.threshold = threshold
        self._trimming = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self._large(scope):
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if not self._trimming:
                self._trimming = True
                try:
                    await asyncio.to_thread(trim_memory)
                finally:
                    self._trimming = False

    def _large(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is None:
            return headers.get(b"transfer-encoding", b"").lower() == b"chunked"
        return not length.isdigit() or int(length) >= self.threshold
