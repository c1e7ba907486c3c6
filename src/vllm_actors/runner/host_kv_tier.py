"""The host KV tier's memory: per layer, a key and a value tensor of ``num_blocks`` blocks in host
memory (pinned on a GPU machine, so copies are DMA), and the block copies between it and the
paged KV cache that a step plan names (runs, ``protocol.block_runs``).

Under a supervisor the memory is a shared-memory file the supervisor owns (``runtime/host_memory.py``,
its descriptor in ``VLLM_ACTORS_KV_OFFLOAD_FD``), so that it outlives this process: a restarted
worker maps the same file and finds the blocks there. Its layout, layer after layer: the layer's
key blocks, then its value blocks, each tensor ``(num_blocks, *block shape)`` of the KV cache's
dtype and starting on a 4 KiB boundary. In one process (no supervisor) it is plain host memory.

Write-through copies (blocks a step has just computed, ``StepPlan.write_through_copies``) follow
the step on the copy stream and overlap the next one; the forward pass ``LAG`` launches later waits
for them (``protocol.write_through``), as does any step that may reuse their blocks.

On a GPU the copies run on a stream of their own, beside the step still running: they wait only
for the step that last used their blocks (the worker's fence, ``actors/worker/copy_fences.py``:
usually a step done long ago), and the compute stream waits for them before the next forward
pass reads the KV. Each launched step records an event for that; events of steps done are
dropped. On a CPU the copies are plain synchronous copies.
"""

from __future__ import annotations

import mmap
import os
from collections import deque
from collections.abc import Sequence

import torch

from vllm_actors.envs import envs
from vllm_actors.protocol.block_runs import iter_runs
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.write_through import LAG

ALIGN = 4096  # each tensor of the shared file starts on a page


def num_host_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """The blocks ``kv_cache_offload_gb`` holds (0: no host tier)."""
    if not config.kv_cache_offload_gb:
        return 0
    count = config.kv_cache_offload_bytes // bytes_per_block
    if count < 1:
        raise ValueError(f"kv_cache_offload_gb ({config.kv_cache_offload_gb}) holds no KV block (one block takes "
                         f"{bytes_per_block / 2**20:.2f} MiB); give it more, or 0 for no host tier")
    return count


def map_shared(fd: int, layout: list[tuple[tuple[int, ...], torch.dtype]],
               pin: bool) -> tuple[mmap.mmap, list[torch.Tensor]]:
    """The tensors of ``layout`` (shape, dtype), in order, in the shared file ``fd`` (grown to fit;
    its content kept): the mapping and the tensors. ``pin``: registered with CUDA, for DMA."""
    offsets, size = [], 0
    for shape, dtype in layout:
        offsets.append(size)
        size += -(-torch.Size(shape).numel() * dtype.itemsize // ALIGN) * ALIGN
    if os.fstat(fd).st_size < size:
        os.ftruncate(fd, size)
    mapping = mmap.mmap(fd, size)
    flat = torch.frombuffer(mapping, dtype=torch.uint8)
    if pin:
        torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), size, 0))
    tensors = [flat[offset:offset + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
               for offset, (shape, dtype) in zip(offsets, layout, strict=True)]
    return mapping, tensors


class HostKvTier:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int,
                 memory_fd: int | None = None) -> None:
        """``memory_fd``: the shared file to map (default: ``VLLM_ACTORS_KV_OFFLOAD_FD``; unset:
        memory of this process)."""
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._gpu = kv_caches
        device = kv_caches[0][0].device
        self._pinned = device.type == "cuda"
        layout = [((num_blocks, *tensor.shape[1:]), tensor.dtype) for pair in kv_caches for tensor in pair]
        fd = envs.VLLM_ACTORS_KV_OFFLOAD_FD if memory_fd is None else memory_fd
        self._mapping: mmap.mmap | None = None
        if fd is None:
            tensors = [torch.empty(shape, dtype=dtype, pin_memory=self._pinned) for shape, dtype in layout]
        else:
            self._mapping, tensors = map_shared(fd, layout, self._pinned)
        self._host = list(zip(tensors[0::2], tensors[1::2], strict=True))
        self._stream = torch.cuda.Stream(device) if self._pinned else None
        self._steps: deque[tuple[int, torch.cuda.Event]] = deque()  # launched steps maybe not done, in order
        self._writes: deque[tuple[int, torch.cuda.Event]] = deque()  # write-throughs: (after step, done)
        self._num_launched = 0

    def step_launched(self, index: int) -> None:
        self._num_launched = index
        if self._stream is None:
            return
        while self._steps and self._steps[0][1].query():
            self._steps.popleft()
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._gpu[0][0].device))
        self._steps.append((index, done))

    def copy(self, offloads: Sequence[int], restores: Sequence[int], fence: int) -> None:
        """Offloads (GPU block, slot, count) first, then restores (slot, GPU block, count), after
        step ``fence`` and ahead of the next forward pass."""
        if not offloads and not restores:
            return
        if self._stream is None:
            self._copy(offloads, restores, non_blocking=False)
            return
        compute = torch.cuda.current_stream(self._gpu[0][0].device)
        waited = next((event for index, event in reversed(self._steps) if index <= fence), None)
        if waited is not None:  # else that step is done (its event was dropped) or there is none
            self._stream.wait_event(waited)
        with torch.cuda.stream(self._stream):
            self._copy(offloads, restores, non_blocking=True)
        compute.wait_stream(self._stream)

    def write_through(self, copies: Sequence[int], fence: int) -> None:
        """Copies (GPU block, slot, count) of blocks step ``fence`` (just launched) writes, after it."""
        if not copies:
            return
        if self._stream is None:
            self._copy(copies, (), non_blocking=False)
            return
        waited = next((event for index, event in reversed(self._steps) if index == fence), None)
        if waited is not None:
            self._stream.wait_event(waited)
        with torch.cuda.stream(self._stream):
            self._copy(copies, (), non_blocking=True)
        done = torch.cuda.Event()
        done.record(self._stream)
        self._writes.append((fence, done))

    def settle(self, reuse: bool) -> None:
        """Before a forward pass: it waits for the write-throughs ``LAG`` launches old (every one
        where the step may reuse blocks, ``reuse``: evictions or a reset)."""
        if self._stream is None:
            return
        compute = torch.cuda.current_stream(self._gpu[0][0].device)
        oldest = self._num_launched + 1 - LAG
        while self._writes and (reuse or self._writes[0][0] <= oldest):
            compute.wait_event(self._writes.popleft()[1])

    def _copy(self, offloads: Sequence[int], restores: Sequence[int], non_blocking: bool) -> None:
        for block, slot, count in iter_runs(offloads):
            for (key, value), (host_key, host_value) in zip(self._gpu, self._host, strict=True):
                host_key[slot:slot + count].copy_(key[block:block + count], non_blocking=non_blocking)
                host_value[slot:slot + count].copy_(value[block:block + count], non_blocking=non_blocking)
        for slot, block, count in iter_runs(restores):
            for (key, value), (host_key, host_value) in zip(self._gpu, self._host, strict=True):
                key[block:block + count].copy_(host_key[slot:slot + count], non_blocking=non_blocking)
                value[block:block + count].copy_(host_value[slot:slot + count], non_blocking=non_blocking)
