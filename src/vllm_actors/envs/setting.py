"""One setting (``Setting``: name, type, default, parser, one line of documentation, its group),
read and parsed at every read through the mapping of an ``Envs``; the shorthands for a switch and
for an op's "Triton or torch"; the groups the reference table shows."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar, overload

from vllm_actors.envs.parsers import KernelChoice, kernel_choice, parse_bool

T = TypeVar("T")

GROUPS = {
    "process": "Processes, logs and files",
    "engine": "Engine paths (switches for debugging and measuring)",
    "kernels": "Kernels",
    "tp": "Tensor parallelism",
    "alias": "Deprecated aliases of engine arguments",
    "other": "Read from other tools' variables",
}


class Reader(Protocol):
    """What a setting is read through (``Envs``): the mapping it reads."""

    environ: Mapping[str, str]


class Setting(Generic[T]):
    """One variable: read through an ``Envs`` instance, declared as a class attribute of its group's
    settings (``envs/process.py`` and the others), which ``Envs`` inherits."""

    name: str

    def __init__(self, default: T, parse: Callable[[str], T], doc: str, *, kind: str, group: str,
                 shown_default: str | None = None, keep_empty: bool = False) -> None:
        if group not in GROUPS:
            raise ValueError(f"unknown group {group!r}")
        self.default = default
        self.parse = parse
        self.doc = doc
        self.kind = kind  # the type as the table shows it
        self.group = group
        self.shown_default = shown_default if shown_default is not None else _shown(default)
        self.keep_empty = keep_empty  # an empty value is a value (else it counts as unset)
        self._last: tuple[str, T] | None = None  # the last text parsed and its value: parsed once per text

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, obj: Reader, owner: type) -> T: ...

    def __get__(self, obj: Reader | None, owner: type) -> Setting[T] | T:
        if obj is None:
            return self
        return self.read(obj.environ)

    def read(self, environ: Mapping[str, str]) -> T:
        raw = environ.get(self.name)
        if raw is None:
            return self.default
        last = self._last
        if last is not None and last[0] == raw:
            return last[1]
        stripped = raw if self.keep_empty else raw.strip()
        if not stripped and not self.keep_empty:
            return self.default
        try:
            value = self.parse(stripped)
        except ValueError as error:
            raise ValueError(f"{self.name} {error}, got {raw!r}") from None
        self._last = (raw, value)
        return value


def _shown(default: object) -> str:
    if default is None:
        return "unset"
    if isinstance(default, bool):
        return "1" if default else "0"
    return str(default)


def switch(doc: str, group: str, default: bool = True) -> Setting[bool]:
    """A path turned on or off."""
    return Setting(default, parse_bool, doc, kind="bool", group=group)


def kernel_switch(what: str, group: str) -> Setting[KernelChoice]:
    """An op's "Triton or torch" (``kernels/choice.py``)."""
    return Setting[KernelChoice]("auto", kernel_choice, f"{what}: `triton`, `torch`, or `auto` (Triton on CUDA).",
                                 kind="auto, torch, triton", group=group)
