"""Triton kernels read module globals only where they are ``tl.constexpr`` (or functions, modules): the CPU
interpreter the suite runs them in accepts a plain ``int`` global, the GPU compiler refuses it
("Cannot access global variable ... from within @jit'ed function"), so only this check catches it here."""

from __future__ import annotations

import importlib
import pkgutil
import types
from typing import Any

import pytest
import triton.language as tl

import vllm_actors

PLAIN = (int, float, bool, str)


def _jit_functions(module: types.ModuleType) -> list[tuple[str, Any]]:
    # JITFunction on the GPU, InterpretedFunction under TRITON_INTERPRET=1: both keep the Python function in `fn`
    return [(name, value) for name, value in vars(module).items()
            if type(value).__module__.startswith("triton")
            and isinstance(getattr(value, "fn", None), types.FunctionType) and value.fn.__module__ == module.__name__]


def _kernel_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(vllm_actors.__path__, "vllm_actors."):
        if ".kernels" in info.name or info.name.endswith(".kernels"):
            names.append(info.name)
    return names


def _plain_globals(function: Any, module: types.ModuleType) -> list[str]:
    code = function.fn.__code__
    names: set[str] = set()
    stack = [code]
    while stack:  # nested code objects (comprehensions, lambdas) included
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(const for const in current.co_consts if isinstance(const, types.CodeType))
    module_globals = vars(module)
    return sorted(name for name in names if name in module_globals
                  and isinstance(module_globals[name], PLAIN) and not isinstance(module_globals[name], tl.constexpr))


@pytest.mark.parametrize("module_name", _kernel_modules())
def test_triton_kernels_read_only_constexpr_globals(module_name: str) -> None:
    module = importlib.import_module(module_name)
    offenders = {name: plain for name, function in _jit_functions(module)
                 if (plain := _plain_globals(function, module))}
    assert not offenders, f"{module_name}: kernels read plain globals (make them tl.constexpr): {offenders}"
