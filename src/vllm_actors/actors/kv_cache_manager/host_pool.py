"""The KV-cache manager's host tier: a bounded pool of host slots (the worker holds the memory,
pinned on a GPU machine) holding cached blocks evicted from the GPU pool, by block hash.

The scheduler's ledger decides which blocks move (``StepPlan.host_dropped_hashes``,
``evicted_hashes``, ``restored_hashes``); this pool picks the slots, checks each decision against
its state and names the copies the worker makes, as runs (``protocol.block_runs``). A block is in
exactly one tier: the manager's ``cached`` (GPU) or here. Pure state machine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_actors.protocol.block_runs import to_runs
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.events import BlockEvicted, BlockOffloaded, BlockRestored
from vllm_actors.protocol.messages import StepPlan


@dataclass(frozen=True, slots=True)
class HostEntry:
    slot: int
    parent_hash: int


class HostPool:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self.entries: dict[int, HostEntry] = {}  # block hash -> its slot

    def __len__(self) -> int:
        return len(self.entries)

    def check(self, plan: StepPlan, evicted_parents: Mapping[int, int]) -> dict[int, int]:
        """Reject the plan's host-tier decisions this state cannot carry out (``MessageRejected``).
        ``evicted_parents``: the parent hash of each block the plan evicts from the GPU pool.
        Returns the parent hash of each restored block."""
        dropped = set(plan.host_dropped_hashes)
        restored = plan.restored_hashes
        if not self.num_slots:
            if dropped or restored:
                raise MessageRejected("the plan moves blocks of a host tier, and there is none")
            return {}
        if len(dropped) != len(plan.host_dropped_hashes) or len(set(restored)) != len(restored):
            raise MessageRejected("the plan drops or restores a host block twice")
        if any(value not in self.entries and value not in evicted_parents for value in dropped):
            raise MessageRejected("the plan drops a block the host tier does not hold")
        # in the plan's own order: what the host holds once the drops and offloads are applied
        arriving = {value: parent for value, parent in evicted_parents.items() if value not in dropped}
        staying = len(self.entries) - sum(1 for value in dropped if value in self.entries)
        size = staying + sum(1 for value in arriving if value not in self.entries)  # else it replaces itself
        if size > self.num_slots:
            raise MessageRejected(f"the plan puts {size} blocks in a host tier of {self.num_slots}")
        parents: dict[int, int] = {}
        for value in restored:
            if value in arriving:
                parents[value] = arriving[value]
            elif value in self.entries and value not in dropped:
                parents[value] = self.entries[value].parent_hash
            else:
                raise MessageRejected(f"the plan restores block hash {value}, which the host tier does not hold")
        return parents

    def drop(self, hashes: list[int], events: list[Any]) -> None:
        """Blocks leave the host tier (and the cache); hashes it does not hold are skipped."""
        gone = [(value, self.entries.pop(value)) for value in hashes if value in self.entries]
        if not gone:
            return
        self._free.extend(entry.slot for _, entry in gone)
        events.append(BlockEvicted(block_ids=[entry.slot for _, entry in gone],
                                   block_hashes=[value for value, _ in gone],
                                   parent_hashes=[entry.parent_hash for _, entry in gone], tier="host"))

    def offload(self, moved: list[tuple[int, int, int]], events: list[Any]) -> list[int]:
        """(hash, GPU block, parent hash) of blocks evicted from the GPU pool to slots here; the
        copies, runs of (GPU block, slot, count)."""
        if not moved:
            return []
        for value, _, _ in moved:
            old = self.entries.pop(value, None)
            if old is not None:  # cached again on the GPU and evicted again: the new copy replaces it
                self._free.append(old.slot)
        # Leaves leave first: in reverse the moved blocks run from the root down, as do a chain's
        # GPU blocks and, on restore, the fresh ones, so a chain's copies merge into runs.
        slots = [self._free.popleft() for _ in moved][::-1]
        for (value, _, parent), slot in zip(moved, slots, strict=True):
            self.entries[value] = HostEntry(slot, parent)
        runs = to_runs([block for _, block, _ in moved], slots)
        events.append(BlockOffloaded(copies=runs, num_blocks=len(moved), num_host_cached=len(self.entries),
                                     num_host_blocks=self.num_slots))
        return runs

    def take(self, hashes: list[int]) -> list[HostEntry]:
        """Blocks going back to the GPU pool: their entries (slots free from now: the worker copies
        them out before any later plan's copies into them)."""
        taken = [self.entries.pop(value) for value in hashes]
        self._free.extend(entry.slot for entry in taken)
        return taken

    def restored(self, slots: list[int], blocks: list[int], events: list[Any]) -> list[int]:
        runs = to_runs(slots, blocks)
        events.append(BlockRestored(copies=runs, num_blocks=len(blocks), num_host_cached=len(self.entries),
                                    num_host_blocks=self.num_slots))
        return runs

    def check_invariants(self, gpu_hashes: set[int]) -> None:
        """Every slot free or holding one block; no block both here and on the GPU."""
        used = [entry.slot for entry in self.entries.values()]
        if len(set(used) | set(self._free)) != self.num_slots or len(used) + len(self._free) != self.num_slots:
            raise AssertionError(f"host slots: {len(used)} used + {len(self._free)} free != {self.num_slots}")
        both = gpu_hashes & set(self.entries)
        if both:
            raise AssertionError(f"blocks cached both on the GPU and in the host tier: {sorted(both)[:8]}")
