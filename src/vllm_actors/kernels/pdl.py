"""Programmatic dependent launch (Hopper and later) for the decoder's own Triton kernels.

In a CUDA graph, each kernel of a batch-1 decode step starts about 0.76 us after the previous one
ends (a fourth-session profile: 0.46 ms a step at TP=2). On Hopper GPUs the kernels are launched
with the programmatic-serialisation attribute: the next kernel is launched while this one runs
(every kernel signals ``gdc_launch_dependents`` once its own wait is over) and waits in ``gdc_wait``
for its predecessor to finish and its writes to be visible, so the launch overlaps the previous
kernel's tail. Every kernel that takes ``PDL`` calls ``pdl_enter`` before it touches memory that a
predecessor may write; the one exception is the GEMV's weight tiles (``kernels/gemv.py``), which no
kernel writes and which it loads before the wait. Kernels launched without the attribute (torch's,
cuBLAS's, NCCL's) wait for the full completion of the kernel before them, as always.

Measured on 2x H100 (seventh session, Qwen3-8B shape, bf16, batch-1 decode in CUDA graphs):
3.890 -> 3.659 ms/token at TP=2 and, with the SiLU fold, 5.956 -> 5.751 at TP=1.
``VLLM_ACTORS_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

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

PDL_ENV = "VLLM_ACTORS_PDL"
_ENABLED = os.environ.get(PDL_ENV, "1") != "0"
EARLY_LOADS_ENV = "VLLM_ACTORS_PDL_EARLY_LOADS"
# Loads of what no kernel of the step writes, or only a kernel two or more launches back (the
# residual stream, norm weights, the step's metadata and slots), issued before ``gdc_wait``: that
# kernel finished before the one before this one passed its own wait, so its writes are visible.
# On by default since measured (2x H100, Qwen3-8B shape, batch 1, one call, two rounds each): TP=2
# 3.287 / 3.290 ms/token against 3.360 / 3.362 off; TP=1 5.593 / 5.591 against 5.604 / 5.604.
# VLLM_ACTORS_PDL_EARLY_LOADS=0 turns it off.
EARLY_LOADS = os.environ.get(EARLY_LOADS_ENV, "1") == "1"


@functools.cache
def _hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl(x: torch.Tensor) -> dict[str, bool]:
    """The launch arguments of a kernel over ``x``: ``PDL`` for ``pdl_enter``, and ``launch_pdl``
    when it is launched as a programmatic dependent (asked for, on a Hopper GPU). Called at every
    launch: the device's capability is asked once per device."""
    on = _ENABLED and HAVE_GDC and x.is_cuda and _hopper_or_later(x.device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
