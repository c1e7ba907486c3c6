"""What the tuned launch tables of the Triton kernels share (``kernels/moe_config.py``,
``kernels/fp8_gemm_config.py``): reading a JSON table file once per process, the tables shipped in
a folder next to the kernels, and the entry measured at the size nearest the one asked (log scale)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def read_json(text: str, what: str, source: str) -> Any:
    """``text`` parsed as JSON; a ValueError naming ``what`` and ``source`` where it is not."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{what} {source}: not JSON ({error})") from None


@lru_cache(maxsize=16)
def read_text(path: str, what: str) -> str:
    """The file's text (cached: tables are read once); a ValueError naming ``what`` where unreadable."""
    try:
        return Path(path).read_text()
    except OSError as error:
        raise ValueError(f"{what} {path}: cannot read ({error.strerror})") from None


def shipped(folder: Path) -> tuple[str, ...]:
    """The ``*.json`` tables of ``folder``, sorted (none where it does not exist)."""
    return tuple(sorted(str(p) for p in folder.glob("*.json"))) if folder.is_dir() else ()


def load(path: str, what: str, parse: Callable[[str, str], T]) -> T:
    """``parse(text, path)`` of the file at ``path`` (the text read once per process)."""
    return parse(read_text(path, what), path)


def nearest(table: dict[int, T], size: int) -> T:
    """The entry measured at the size nearest ``size`` on a log scale (the smaller on a tie)."""
    best = min(table, key=lambda measured: (abs(math.log2(measured) - math.log2(max(size, 1))), measured))
    return table[best]
