"""What the tuned launch tables of the Triton kernels share (``kernels/moe_config.py``,
``kernels/fp8_gemm_config.py``): reading a JSON table file once per process, the tables shipped in
a folder next to the kernels, and the entry measured at the size nearest the one asked (log scale)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
K = TypeVar("K")


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


@lru_cache(maxsize=8)
def shipped(folder: Path) -> tuple[str, ...]:
    """The ``*.json`` tables of ``folder``, sorted (none where it does not exist; listed once per process:
    the lookups run on every call of the kernels)."""
    return tuple(sorted(str(p) for p in folder.glob("*.json"))) if folder.is_dir() else ()


def load(path: str, what: str, parse: Callable[[str, str], T]) -> T:
    """``parse(text, path)`` of the file at ``path`` (the text read once per process)."""
    return parse(read_text(path, what), path)


def nearest(table: dict[int, T], size: int) -> T:
    """The entry measured at the size nearest ``size`` on a log scale (the smaller on a tie)."""
    best = min(table, key=lambda measured: (abs(math.log2(measured) - math.log2(max(size, 1))), measured))
    return table[best]


def parse_sized(configs: Any, where: str, size: str, parse: Callable[[Any, str], T], field: str = "configs"
                ) -> dict[int, T]:
    """A table's ``field`` (``configs``): an object of ``size`` (a whole number >= 1, as a string) -> an
    entry read by ``parse(raw, where)``; a ValueError naming ``where`` if malformed."""
    if not isinstance(configs, dict) or not configs:
        raise ValueError(f"{where}.{field} must be a non-empty object of {size} -> config")
    parsed: dict[int, T] = {}
    for key, raw in configs.items():
        if not str(key).isdigit() or int(key) < 1:
            raise ValueError(f"{where}.{field} key {key!r}: must be a {size} >= 1")
        parsed[int(key)] = parse(raw, f"{where}.{field}[{key}]")
    return parsed


def lookup(sources: Iterable[dict[K, T]], key: Callable[[str], K], device: str) -> T | None:
    """The first source's table at ``key(device)``, else at ``key("any")`` (a table for every device)."""
    for tables in sources:
        for name in (device, "any"):
            table = tables.get(key(name))
            if table is not None:
                return table
    return None


def check_fields(entry: Any, where: str, choices: dict[str, Iterable[int]]) -> None:
    """A ValueError naming ``where`` unless each field of ``choices`` is one of its values and the
    entry's ``group_m`` (where it has one) a whole number >= 1."""
    for name, values in choices.items():
        value = getattr(entry, name)
        if not isinstance(value, int) or value not in values:
            raise ValueError(f"{where}.{name} is {value!r}: must be one of {list(values)}")
    group_m = getattr(entry, "group_m", 1)
    if not isinstance(group_m, int) or group_m < 1:
        raise ValueError(f"{where}.group_m is {group_m!r}: must be a whole number >= 1")
