"""Programmatic dependent launch (Hopper and later) for the decoder's own Triton kernels.

In a CUDA graph each kernel of a batch-1 decode step starts a short gap after the previous one
ends. On Hopper GPUs the kernels are launched with the programmatic-serialisation attribute: the
next kernel is launched while this one runs (every kernel signals ``gdc_launch_dependents`` once
its own wait is over) and waits in ``gdc_wait`` for its predecessor to finish and its writes to be
visible, so the launch overlaps the previous kernel's tail. Every kernel that takes ``PDL`` calls
``pdl_enter`` before it touches memory that a predecessor may write; the one exception is the
GEMV's weight tiles (``kernels/gemv.py``), which no kernel writes and which it loads before the
wait. Kernels launched without the attribute (torch's, cuBLAS's, NCCL's) wait for the full
completion of the kernel before them, as always. ``VLLM_ACTORS_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from vllm_actors.envs import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAVE_GDC = True
except ImportError:  # a triton without grid dependency control: PDL stays off
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():  # type: ignore[no-redef]
        pass

    @triton.jit
    def gdc_launch_dependents():  # type: ignore[no-redef]
        pass


def early_loads() -> bool:
    """Loads of what no kernel of the step writes, or only a kernel two or more launches back (the
    residual stream, norm weights, the step's metadata and slots), issued before ``gdc_wait``: that
    kernel finished before the one before this one passed its own wait, so its writes are visible.
    On unless ``VLLM_ACTORS_PDL_EARLY_LOADS=0``."""
    return envs.VLLM_ACTORS_PDL_EARLY_LOADS


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl(x: torch.Tensor) -> dict[str, bool]:
    """The launch arguments of a kernel over ``x``: ``PDL`` for ``pdl_enter``, and ``launch_pdl``
    when it is launched as a programmatic dependent (asked for, on a Hopper GPU). Called at every
    launch: the device's capability is asked once per device."""
    on = HAVE_GDC and x.is_cuda and envs.VLLM_ACTORS_PDL and _hopper_or_later(x.device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
