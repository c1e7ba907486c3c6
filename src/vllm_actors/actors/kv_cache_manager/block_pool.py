"""The KV-cache manager's pool of block ids: a free list and reference counts (cached blocks are
shared).

Under KV parallelism (``ranks`` > 1) the pool is the union of every KV-parallel rank's pool: block
id ``b`` is local block ``b // ranks`` of rank ``b % ranks``. Each rank's free blocks are kept apart,
and a request's ``j``-th block is taken from rank ``j % ranks`` (interleaved: a growing request
spreads its blocks and its attention evenly), from the rank with the most free blocks when that
one has none. So a request can always use the whole pool (allocation needs only the total free
count, as the scheduler counts it), and the placement is balanced while every rank has room.
"""

from __future__ import annotations

from collections import deque


class BlockPoolExhausted(RuntimeError):
    """More blocks asked for than are free. The manager checks every plan first (a plan needing
    too many is rejected whole), so this is a bug: the actor crashes."""


class BlockPool:
    """Fixed pool of KV blocks with reference counts (cached blocks are shared)."""

    def __init__(self, num_blocks: int, ranks: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if ranks < 1 or num_blocks % ranks:
            raise ValueError(f"num_blocks ({num_blocks}) must be a multiple of the KV-parallel ranks ({ranks})")
        self.num_blocks = num_blocks
        self.ranks = ranks
        self._free: list[deque[int]] = [deque(range(rank, num_blocks, ranks)) for rank in range(ranks)]
        self._num_free = num_blocks
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, count: int, first_index: int = 0) -> list[int]:
        """``count`` blocks for positions ``first_index``, ``first_index + 1``, ... of a table."""
        if count > self._num_free:
            raise BlockPoolExhausted(f"asked for {count} blocks, {self._num_free} free")
        if self.ranks == 1:
            free = self._free[0]
            blocks = [free.popleft() for _ in range(count)]
        else:
            blocks = [self._take((first_index + i) % self.ranks) for i in range(count)]
        self._num_free -= count
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def _take(self, rank: int) -> int:
        free = self._free[rank]
        if not free:  # this rank is full: the one with the most room
            free = max(self._free, key=len)
        return free.popleft()

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
                self._free[block % self.ranks].append(block)
                self._num_free += 1

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def free_blocks(self) -> list[int]:
        return [block for free in self._free for block in free]

    def free_per_rank(self) -> list[int]:
        """Free blocks of each KV-parallel rank."""
        return [len(free) for free in self._free]
