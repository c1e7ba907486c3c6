"""flash-attn 4's varlen forward without its per-call Python: each kind of call runs once through
``flash_attn_varlen_func``, which leaves its compiled kernel and argument list behind; later calls of that
kind call the kernel directly with their own tensors.

Why: a call through flash-attn's interface is ~0.3 ms of host Python (the autograd Function, argument
checks, the config and compile-key computation) before a kernel whose own TVM-FFI call takes ~0.013 ms
(H200 host, flash-attn-4 4.0.0b36). A mixed step of the 1B shape whose long chunk is split over its keys
makes two calls a layer: 10 ms of a ~25 ms launch, on a step whose decodes wait for it.

How: the recording call swaps flash-attn's fwd compile cache for one that notes the compiled kernel and the
arguments it is called with. Each tensor argument must be one of the call's own (q, k, v, ``cu_seqlens_q``,
``seqused_k``, ``page_table``, matched by address, shape and strides) or the output and log-sum-exp the
call returned; else (metadata flash-attn computed for that call, a second kernel, another version's
interface) the kind stays on the interface. A kind is every input the interface decides from but tensor
values and sizes: dtypes, the sizes of the head and cache dimensions, strides, the options, the scale; a
batch above flash-attn's ``BIN_BATCH_SEARCH_THRESH`` (where it computes per-call scheduler metadata) is
never replayed. A kind is replayed once two recordings whose rows and sequences both differ left the same
arguments but the tensors: nothing the interface derived from the sizes is then frozen in.
The replay allocates the output ``[T, H, D]`` (q's dtype) and the LSE ``[H, T]`` (float32) as it does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VarlenFunc = Callable[..., Any]
INPUTS = ("q", "k", "v", "cu_seqlens_q", "seqused_k", "page_table")
OPTIONS = ("softmax_scale", "causal", "window_size", "softcap", "pack_gqa", "return_lse")
KNOWN = frozenset(INPUTS + OPTIONS)  # a call with any other argument stays on the interface
BIN_BATCH_SEARCH_THRESH = 256  # flash-attn 4's default, read from its interface where it has one


@dataclass(frozen=True, slots=True)
class Replay:
    """One kind of call: the compiled kernel, its arguments with the per-call ones left None, and where
    those go (``slots``: position -> an input's name, ``out`` or ``lse``)."""

    kernel: Callable[..., Any]
    template: tuple[Any, ...]
    slots: tuple[tuple[int, str], ...]
    return_lse: bool


class _Recorder:
    """Stands in for flash-attn's fwd compile cache during one call: lookups pass through, the kernel
    it hands out notes its arguments."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __setitem__(self, key: object, value: Any) -> None:
        self.inner[key] = value

    def __getitem__(self, key: object) -> Callable[..., Any]:
        kernel = self.inner[key]

        def noted(*args: Any) -> Any:
            self.calls.append((kernel, args))
            return kernel(*args)

        return noted


def _layout(name: str, t: torch.Tensor) -> tuple[Any, ...]:
    """A tensor's kind: dtype, device, rank and unit last stride; the sizes but the first and the strides of
    q, k and v (heads, head dim, the cache's page size); the batch and table width vary within a kind."""
    shape = tuple(t.shape[1:]) + tuple(t.stride()) if name in ("q", "k", "v") else ()
    return (t.dtype, t.device, t.dim(), t.stride(-1) == 1, shape)


def _sizes(arguments: dict[str, Any]) -> tuple[int, ...]:
    """What varies within a kind: q rows, sequences, table width (the first two must differ to confirm one)."""
    table = arguments.get("page_table")
    return (arguments["q"].shape[0], arguments["cu_seqlens_q"].shape[0], -1 if table is None else table.shape[-1])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class FlashAttnReplay:
    """``flash_attn_varlen_func(**arguments)`` -> ``(out, lse)``, replayed per kind where it can be
    (``module``: ``flash_attn.cute.interface``, whose ``_flash_attn_fwd.compile_cache`` is recorded)."""

    def __init__(self, varlen: VarlenFunc, module: Any) -> None:
        self.varlen = varlen
        self.module = module
        self.batch_limit = int(getattr(module, "BIN_BATCH_SEARCH_THRESH", BIN_BATCH_SEARCH_THRESH))
        self.replays: dict[tuple[Any, ...], Replay | None] = {}  # None: that kind stays on the interface
        self.candidates: dict[tuple[Any, ...], tuple[Replay, tuple[int, ...]]] = {}  # recorded once
        self._lock = threading.Lock()

    def kind(self, arguments: dict[str, Any]) -> tuple[Any, ...] | None:
        """The call's kind; None where it is not replayed (an unknown argument, a batch over the limit)."""
        if not KNOWN.issuperset(arguments):
            return None
        tensors = [arguments.get(name) for name in INPUTS]
        if any(t is not None and not isinstance(t, torch.Tensor) for t in tensors):
            return None
        cu = arguments.get("cu_seqlens_q")
        if cu is None or cu.shape[0] - 1 > self.batch_limit:
            return None
        return (tuple(None if t is None else _layout(name, t) for name, t in zip(INPUTS, tensors, strict=True)),
                tuple(repr(arguments.get(name)) for name in OPTIONS))

    def __call__(self, **arguments: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        kind = self.kind(arguments)
        if kind is None:
            return self._interface(arguments)
        if kind not in self.replays:
            return self._record(kind, arguments)
        replay = self.replays[kind]
        if replay is None:
            return self._interface(arguments)
        return self._replay(replay, arguments)

    def _interface(self, arguments: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.varlen(**arguments)
        return (out[0], out[1]) if isinstance(out, tuple) else (out, None)

    def _record(self, kind: tuple[Any, ...], arguments: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        fwd: Any = getattr(self.module, "_flash_attn_fwd", None)
        cache = getattr(fwd, "compile_cache", None)
        if fwd is None or cache is None:
            self.replays[kind] = None
            return self._interface(arguments)
        recorder = _Recorder(cache)
        with self._lock:
            fwd.compile_cache = recorder
            try:
                out, lse = self._interface(arguments)
            finally:
                fwd.compile_cache = cache
        replay = self._replay_of(recorder.calls, arguments, out, lse)
        sizes = _sizes(arguments)
        candidate = self.candidates.get(kind)
        if replay is None:
            self.replays[kind] = None
        elif candidate is None:
            self.candidates[kind] = (replay, sizes)
        elif all(a != b for a, b in zip(candidate[1][:2], sizes[:2], strict=True)):  # rows and sequences both
            # differ: a second size confirms the kind, or refuses it
            del self.candidates[kind]
            self.replays[kind] = replay if _same_template(candidate[0], replay) else None
        return out, lse

    @staticmethod
    def _replay_of(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]], arguments: dict[str, Any],
                   out: torch.Tensor, lse: torch.Tensor | None) -> Replay | None:
        """The recorded call as a replay; None where a tensor argument is not the call's own."""
        if len(calls) != 1:
            return None
        kernel, args = calls[0]
        q = arguments["q"]
        total, num_heads = q.shape[0], q.shape[1]
        if out.dtype != q.dtype or out.shape[:2] != (total, num_heads) or not out.is_contiguous():
            return None
        return_lse = bool(arguments.get("return_lse", False))
        if return_lse and (lse is None or lse.dtype != torch.float32 or lse.shape != (num_heads, total)
                           or not lse.is_contiguous()):
            return None
        known = [(name, arguments[name]) for name in INPUTS if arguments.get(name) is not None]
        known.append(("out", out))
        if return_lse and lse is not None:
            known.append(("lse", lse))
        template: list[Any] = []
        slots: list[tuple[int, str]] = []
        for position, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                name = next((name for name, t in known if _same(arg, t)), None)
                if name is None:
                    return None
                slots.append((position, name))
                template.append(None)
            elif isinstance(arg, list | tuple | dict) and _holds_tensor(arg):
                return None
            else:
                template.append(arg)
        if not any(name == "out" for _, name in slots):
            return None
        return Replay(kernel, tuple(template), tuple(slots), return_lse and lse is not None)

    @staticmethod
    def _replay(replay: Replay, arguments: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
        q, v = arguments["q"], arguments["v"]
        total, num_heads = q.shape[0], q.shape[1]
        filled = dict(arguments)
        filled["out"] = torch.empty((total, num_heads, v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty((num_heads, total), dtype=torch.float32, device=q.device) if replay.return_lse else None
        filled["lse"] = lse
        args = list(replay.template)
        for position, name in replay.slots:
            args[position] = filled[name]
        replay.kernel(*args)
        return filled["out"], lse


def _same_template(a: Replay, b: Replay) -> bool:
    """Two recordings of one kind left the same kernel and arguments but the tensors."""
    if a.kernel is not b.kernel or a.slots != b.slots or len(a.template) != len(b.template):
        return False
    try:
        return all(x is y or bool(x == y) for x, y in zip(a.template, b.template, strict=True))
    except Exception:  # an argument without a usable equality: not replayed
        return False


def _holds_tensor(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(item, torch.Tensor) or (isinstance(item, list | tuple | dict) and _holds_tensor(item))
               for item in items)
