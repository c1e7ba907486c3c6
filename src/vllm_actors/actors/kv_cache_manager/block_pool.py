"""The KV-cache manager's pool of block ids: a free list and reference counts (cached blocks are
shared)."""

from __future__ import annotations

from collections import deque


class BlockPoolExhausted(RuntimeError):
    """More blocks asked for than are free. The manager checks every plan first (a plan needing
    too many is rejected whole), so this is a bug: the actor crashes."""


class BlockPool:
    """Fixed pool of KV blocks with reference counts (cached blocks are shared)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise BlockPoolExhausted(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """One more holder for blocks already in use."""
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} shared while free")
            self._ref_counts[block] += 1

    def release(self, blocks: list[int]) -> None:
        for block in blocks:
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} released while not referenced")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def free_blocks(self) -> list[int]:
        return list(self._free)
