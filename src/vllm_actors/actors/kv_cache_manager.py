"""The KV-cache manager: owns the block pool and every request's block table.

It sits in the step pipeline between the scheduler and the workers. The scheduler decides how many
blocks each request holds (it keeps the same count, so it can plan preemption without a round
trip); this actor decides which blocks, frees those of departed requests and forwards the plan with
the appended block ids to the workers. Pure state machine: no sockets, no clock.
"""

from __future__ import annotations

from collections import deque

import msgspec

from typing import Any

from vllm_actors.protocol.events import Allocated, Freed
from vllm_actors.protocol.messages import Message, StepPlan

WORKER = "worker"
BUS = "bus"


class BlockPoolExhausted(RuntimeError):
    """The scheduler asked for more blocks than are free: its accounting and ours disagree."""


class BlockPool:
    """Fixed pool of KV blocks with reference counts (prefix caching will share blocks)."""

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


class KVCacheManager:
    name = "kv_cache_manager"

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    def handle(self, message: Message) -> list[tuple[str, Any]]:
        if not isinstance(message, StepPlan):
            raise TypeError(f"the KV-cache manager does not take {type(message).__name__}")
        events: list[Any] = []
        plan = self.assign_blocks(message, events)
        return [(WORKER, plan), *((BUS, event) for event in events)]

    def assign_blocks(self, plan: StepPlan, events: list[Any] | None = None) -> StepPlan:
        """Free the blocks of departed requests, then give each scheduled request the blocks it
        needs. Checks the whole plan before changing anything, so a bad plan changes nothing."""
        if len(plan.req_ids) != len(plan.num_blocks):
            raise ValueError("req_ids and num_blocks differ in length")
        freed = sum(len(self.block_tables.get(request_id, ())) for request_id in plan.finished_ids)
        needed = sum(
            max(wanted - len(self.block_tables.get(request_id, ())), 0)
            for request_id, wanted in zip(plan.req_ids, plan.num_blocks, strict=True)
        )
        if needed > self.pool.num_free + freed:
            raise BlockPoolExhausted(f"the plan needs {needed} blocks, {self.pool.num_free + freed} free")
        for request_id in plan.finished_ids:
            table = self.block_tables.pop(request_id, [])
            self.pool.release(table)
            if table and events is not None:
                events.append(Freed(request_id=request_id, num_blocks=len(table), num_free_blocks=self.pool.num_free))
        new_block_ids: list[list[int]] = []
        for request_id, wanted in zip(plan.req_ids, plan.num_blocks, strict=True):
            table = self.block_tables.setdefault(request_id, [])
            added = self.pool.allocate(wanted - len(table)) if wanted > len(table) else []
            table.extend(added)
            new_block_ids.append(added)
            if added and events is not None:
                events.append(Allocated(request_id=request_id, block_ids=added, num_free_blocks=self.pool.num_free))
        return msgspec.structs.replace(plan, new_block_ids=new_block_ids)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def check_invariants(self, live_request_ids: set[str] | None = None) -> None:
        """free + in use == total; no block both free and referenced; no table of a dead request."""
        in_use = {block for table in self.block_tables.values() for block in table}
        free = self.pool.free_blocks()
        if len(free) != len(set(free)):
            raise AssertionError("a block is on the free list twice")
        if in_use & set(free):
            raise AssertionError(f"blocks both free and referenced: {sorted(in_use & set(free))[:8]}")
        if len(in_use) + len(free) != self.pool.num_blocks:
            raise AssertionError(
                f"free ({len(free)}) + in use ({len(in_use)}) != total ({self.pool.num_blocks})"
            )
        if live_request_ids is not None:
            stale = set(self.block_tables) - live_request_ids
            if stale:
                raise AssertionError(f"blocks still referenced by finished requests: {sorted(stale)}")
