"""Building a model's modules on the meta device, then giving them memory, without the torch paths
that import its compiler: ``nn.init``'s draws on meta tensors and ``to_empty``'s ``empty_like`` of
a meta tensor run torch's Python references, whose first calls import ``torch._dynamo`` and sympy
(about 3 s of CPU in every worker's start). The weights are loaded (or drawn) afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

M = TypeVar("M", bound=nn.Module)


class _SkipInit(TorchFunctionMode):
    """``torch.nn.init``'s functions return their tensor untouched; every other function runs."""

    def __torch_function__(self, func: Callable[..., Any], types: Sequence[type], args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


@contextmanager
def meta_modules() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device, never initialised."""
    with torch.device("meta"), _SkipInit():
        yield


def materialize(module: M, device: torch.device) -> M:
    """``module.to_empty(device=device)``: every parameter and buffer uninitialised memory of its
    shape, strides and dtype on ``device`` (tied parameters come apart: tie them again)."""
    return module._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
