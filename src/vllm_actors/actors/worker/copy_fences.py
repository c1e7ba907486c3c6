"""Which launched step a plan's host-tier copies must wait for, so that they can run beside the
step still on the device instead of behind it.

A copy touches blocks no live request holds: a restore fills a free block, an offload reads an
idle cached one. Such a block was last used by a request that has since left, so the copies need
only the steps launched before that request left to be done: the step count at each block's
release is its fence. Blocks released long ago (the usual case: the pool hands out its longest
free blocks first, and evicts its least recently used) fence on steps done by now, and the copies
overlap the running step. A reset fences every block on the last step launched before it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from vllm_actors.protocol.block_runs import iter_runs


class CopyFences:
    def __init__(self) -> None:
        self.num_launched = 0  # steps launched so far; step k is the k-th (1-based)
        self._released: dict[int, int] = {}  # block -> steps launched when it was last released
        self._floor = 0  # every block: the steps launched before the last reset

    def launched(self) -> int:
        """A step's forward pass was queued: its index."""
        self.num_launched += 1
        return self.num_launched

    def release(self, blocks: Iterable[int]) -> None:
        """A request holding these blocks left: steps launched so far may still read them."""
        now = self.num_launched
        for block in blocks:
            self._released[block] = now

    def reset(self) -> None:
        self._released.clear()
        self._floor = self.num_launched

    def fence(self, offloads: Sequence[int], restores: Sequence[int]) -> int:
        """The step the copies wait for (0: none): offloads read (GPU block, slot, count) runs'
        blocks, restores fill (slot, GPU block, count) runs' blocks."""
        released = self._released
        latest = self._floor
        for first, _, count in iter_runs(offloads):
            latest = max(latest, max((released.get(block, 0) for block in range(first, first + count)), default=0))
        for _, first, count in iter_runs(restores):
            latest = max(latest, max((released.get(block, 0) for block in range(first, first + count)), default=0))
        return latest
