"""The host KV tier's memory: per layer, a key and a value tensor of ``num_blocks`` blocks in host
memory (pinned on a GPU machine, so copies are DMA), and the block copies between it and the
paged KV cache that a step plan names (runs, ``protocol.block_runs``).

On a GPU the copies run on a stream of their own, beside the step still running: they wait only
for the step that last used their blocks (the worker's fence, ``actors/worker/copy_fences.py``:
usually a step done long ago), and the compute stream waits for them before the next forward
pass reads the KV. Each launched step records an event for that; events of steps done are
dropped. On a CPU the copies are plain synchronous copies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from vllm_actors.protocol.block_runs import iter_runs
from vllm_actors.protocol.config import EngineConfig


def num_host_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """The blocks ``kv_cache_offload_gb`` holds (0: no host tier)."""
    if not config.kv_cache_offload_gb:
        return 0
    count = config.kv_cache_offload_bytes // bytes_per_block
    if count < 1:
        raise ValueError(f"kv_cache_offload_gb ({config.kv_cache_offload_gb}) holds no KV block (one block takes "
                         f"{bytes_per_block / 2**20:.2f} MiB); give it more, or 0 for no host tier")
    return count


class HostKvTier:
    def __init__(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._gpu = kv_caches
        device = kv_caches[0][0].device
        self._pinned = device.type == "cuda"
        shape = (num_blocks, *kv_caches[0][0].shape[1:])
        self._host = [
            (torch.empty(shape, dtype=key.dtype, pin_memory=self._pinned),
             torch.empty(shape, dtype=value.dtype, pin_memory=self._pinned))
            for key, value in kv_caches
        ]
        self._stream = torch.cuda.Stream(device) if self._pinned else None
        self._steps: deque[tuple[int, torch.cuda.Event]] = deque()  # launched steps maybe not done, in order

    def step_launched(self, index: int) -> None:
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

    def _copy(self, offloads: Sequence[int], restores: Sequence[int], non_blocking: bool) -> None:
        for block, slot, count in iter_runs(offloads):
            for (key, value), (host_key, host_value) in zip(self._gpu, self._host, strict=True):
                host_key[slot:slot + count].copy_(key[block:block + count], non_blocking=non_blocking)
                host_value[slot:slot + count].copy_(value[block:block + count], non_blocking=non_blocking)
        for slot, block, count in iter_runs(restores):
            for (key, value), (host_key, host_value) in zip(self._gpu, self._host, strict=True):
                key[block:block + count].copy_(host_key[slot:slot + count], non_blocking=non_blocking)
                value[block:block + count].copy_(host_value[slot:slot + count], non_blocking=non_blocking)
