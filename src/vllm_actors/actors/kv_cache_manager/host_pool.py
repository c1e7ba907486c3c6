"""The KV-cache manager's host tier: a bounded pool of host slots (the worker holds the memory,
pinned on a GPU machine) holding cached blocks evicted from the GPU pool, by block hash.

The scheduler's ledger decides which blocks move (``StepPlan.host_dropped_hashes``,
``evicted_hashes``, ``restored_hashes``); this pool picks the slots, checks each decision against
its state and names the copies the worker makes, as runs (``protocol.block_runs``). A block is in
exactly one tier: the manager's ``cached`` (GPU) or here (``entries``), except for backups: blocks
cached on the GPU whose copy is also here (write-through, ``StepPlan.backup_hashes``). An evicted
backup stays in its slot, uncopied; after a worker's restart (``resumed``) the backups are all that
is left of those blocks. Pure state machine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping
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
        self.backups: dict[int, HostEntry] = {}  # blocks cached on the GPU too -> their slot here

    def __len__(self) -> int:
        return len(self.entries) + len(self.backups)

    def check(self, plan: StepPlan, evicted_parents: Mapping[int, int], cached_now: Collection[int]) -> dict[int, int]:
        """Reject the plan's host-tier decisions this state cannot carry out (``MessageRejected``).
        ``evicted_parents``: the parent hash of each block the plan evicts from the GPU pool;
        ``cached_now``: the blocks it caches. Returns the parent hash of each restored block."""
        dropped = set(plan.host_dropped_hashes)
        restored = plan.restored_hashes
        backups = plan.backup_hashes
        if not self.num_slots:
            if dropped or restored or backups:
                raise MessageRejected("the plan moves blocks of a host tier, and there is none")
            return {}
        if len(dropped) != len(plan.host_dropped_hashes) or len(set(restored)) != len(restored):
            raise MessageRejected("the plan drops or restores a host block twice")
        held = self.entries.keys() | self.backups.keys()
        if any(value not in held and value not in evicted_parents for value in dropped):
            raise MessageRejected("the plan drops a block the host tier does not hold")
        if len(set(backups)) != len(backups) or any(value not in cached_now or (value in held and value not in dropped)
                                             for value in backups):
            raise MessageRejected("the plan backs up a block it does not cache, or one the host tier holds")
        # in the plan's own order: what the host holds once the drops and offloads are applied
        arriving = {value: parent for value, parent in evicted_parents.items() if value not in dropped}
        staying = len(held) - sum(1 for value in dropped if value in held)
        size = staying + sum(1 for value in arriving if value not in held)  # else in its slot already
        if max(size, size - len(restored) + len(backups)) > self.num_slots:
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
        """Blocks leave the host tier (and the cache; a backup's block stays cached on the GPU);
        hashes it does not hold are skipped."""
        self._free.extend(self.backups.pop(value).slot for value in hashes if value in self.backups)
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
        backed_up = [(value, self.backups.pop(value)) for value, _, _ in moved if value in self.backups]
        self.entries.update(backed_up)  # already here: they stay in their slots, uncopied
        if backed_up:
            kept = {value for value, _ in backed_up}
            moved = [move for move in moved if move[0] not in kept]
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
        events.append(BlockOffloaded(copies=runs, num_blocks=len(moved), num_host_cached=len(self),
                                     num_host_blocks=self.num_slots))
        return runs

    def back_up(self, cached: list[tuple[int, int, int]], events: list[Any]) -> list[int]:
        """(hash, GPU block, parent hash) of blocks just cached, copied to slots here as well (after
        the step writes them); the copies, runs of (GPU block, slot, count)."""
        if not cached:
            return []
        slots = [self._free.popleft() for _ in cached]
        for (value, _, parent), slot in zip(cached, slots, strict=True):
            self.backups[value] = HostEntry(slot, parent)
        runs = to_runs([block for _, block, _ in cached], slots)
        events.append(BlockOffloaded(copies=runs, num_blocks=len(cached), num_host_cached=len(self),
                                     num_host_blocks=self.num_slots, write_through=True))
        return runs

    def resumed(self) -> HostPool:
        """The pool after a worker's restart: the same slots, the backups now held here alone."""
        pool = HostPool(self.num_slots)
        pool.entries = {**self.entries, **self.backups}
        pool._free = deque(self._free)
        return pool

    def take(self, hashes: list[int]) -> list[HostEntry]:
        """Blocks going back to the GPU pool: their entries (slots free from now: the worker copies
        them out before any later plan's copies into them)."""
        taken = [self.entries.pop(value) for value in hashes]
        self._free.extend(entry.slot for entry in taken)
        return taken

    def restored(self, slots: list[int], blocks: list[int], events: list[Any]) -> list[int]:
        runs = to_runs(slots, blocks)
        events.append(BlockRestored(copies=runs, num_blocks=len(blocks), num_host_cached=len(self),
                                    num_host_blocks=self.num_slots))
        return runs

    def check_invariants(self, gpu_hashes: set[int]) -> None:
        """Every slot free or holding one block; no block both here and on the GPU but backups, which
        are on the GPU."""
        used = [entry.slot for entry in (*self.entries.values(), *self.backups.values())]
        if len(set(used) | set(self._free)) != self.num_slots or len(used) + len(self._free) != self.num_slots:
            raise AssertionError(f"host slots: {len(used)} used + {len(self._free)} free != {self.num_slots}")
        both = gpu_hashes & set(self.entries)
        if both:
            raise AssertionError(f"blocks cached both on the GPU and in the host tier: {sorted(both)[:8]}")
        if not set(self.backups) <= gpu_hashes:
            missing = sorted(set(self.backups) - gpu_hashes)[:8]
            raise AssertionError(f"backups of blocks not cached on the GPU: {missing}")
