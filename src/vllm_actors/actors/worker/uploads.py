"""Small host-to-device uploads that never make the host wait for the GPU.

``torch.tensor(values, device="cuda")``, and indexing a CUDA tensor with a Python list, copy with a
blocking copy: the host waits until the GPU has run everything queued before it. In the worker's
launch path that is the step just launched, so the host's work on the next step stops overlapping
the GPU's. ``upload`` stages the values in pinned memory (PyTorch's caching host allocator, which
keeps a buffer until its copy is done) and copies asynchronously, ordered on the current stream, as
vLLM's ``async_tensor_h2d`` does. The worker's modules use it for every list they send to the
device (a test in tests/models/test_uploads.py holds them to it).

Assigning a Python number through index tensors (``logits[rows, ids] = -inf``) blocks too:
``index_put_`` copies the number, made a CPU scalar tensor, to the device with a blocking copy.
``fill_at`` hands it a scalar made on the device instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence[int] | Sequence[float], device: torch.device,
           dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` as a tensor on ``device``, without waiting for the device."""
    if device.type == "cpu":
        return torch.tensor(values, dtype=dtype)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def fill_at(tensor: torch.Tensor, indices: tuple[torch.Tensor, ...], value: float | bool) -> None:
    """``tensor[indices] = value`` in place, without waiting for the device."""
    tensor.index_put_(indices, torch.full((), value, dtype=tensor.dtype, device=tensor.device))
