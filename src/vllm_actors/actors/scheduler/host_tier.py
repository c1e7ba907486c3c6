"""The scheduler's view of the host KV tier: which cached blocks left the GPU pool for host memory
(by block hash, with their parent and tokens), in the order they went there, within a bound; and
which blocks cached on the GPU also have a copy there (write-through of long prompts).

The ledger decides everything about the tier, as it does for the GPU pool: a block evicted from
the GPU pool is offered here (``offer``); when the tier is full its oldest blocks are dropped (they
leave the cache); a request whose prompt continues past its GPU hit into blocks held here takes
them back (``take``: the KV-cache manager copies them into fresh GPU blocks). The plan carries the
decisions; the KV-cache manager owns the host slots and the worker the memory.

Write-through (``back_up``): a long prompt's blocks are copied here as they are computed, while
they stay cached on the GPU (``backups``). Evicted later, such a block needs no copy. After a
worker restart the GPU's blocks are gone and the backups are all that is left of them: ``resume``
makes them host blocks, keeping only the copies known complete (``protocol.write_through``: each
arrival carries the step id of its plan, ``stamp``).

Oldest first drops leaves first: the GPU pool evicts leaf blocks first, so a block's children
reached the host before it did. Blocks taken back in a planning pass keep their slot until the
plan is applied (the manager copies them out after the pass's offloads): they count against the
bound until ``end_pass``. Pure bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_actors.protocol.block_hash import block_hash


@dataclass(frozen=True, slots=True)
class HostBlock:
    parent_hash: int
    token_ids: tuple[int, ...]


class HostTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"the host tier's size must be >= 0 blocks, got {num_blocks}")
        self.capacity = num_blocks
        self.blocks: OrderedDict[int, HostBlock] = OrderedDict()  # hash -> block, oldest first
        self.backups: OrderedDict[int, HostBlock] = OrderedDict()  # cached on the GPU too, oldest first
        self.arrived: dict[int, int] = {}  # hash -> step id of the plan that copied it here
        self.num_taken = 0  # blocks taken back this pass: their slots are still in use

    def __len__(self) -> int:
        return len(self.blocks) + len(self.backups)

    def __contains__(self, block_hash_: int) -> bool:
        return block_hash_ in self.blocks

    @property
    def _full(self) -> bool:
        return len(self.blocks) + len(self.backups) + self.num_taken >= self.capacity

    def offer(self, block_hash_: int, parent_hash: int, token_ids: tuple[int, ...]) -> tuple[bool, list[int]]:
        """A block evicted from the GPU pool: (kept here, hashes dropped to make room: host blocks
        first, then backups). A block with a backup stays in its slot, uncopied."""
        backup = self.backups.pop(block_hash_, None)
        if backup is not None:
            self.blocks[block_hash_] = backup
            return True, []
        dropped = self._make_room(also_backups=True)
        if self._full:
            return False, dropped
        self.blocks[block_hash_] = HostBlock(parent_hash, token_ids)
        return True, dropped

    def back_up(self, block_hash_: int, parent_hash: int, token_ids: tuple[int, ...]) -> tuple[bool, list[int]]:
        """A block just cached on the GPU, to be copied here too: (kept, host blocks dropped to make
        room; never another backup)."""
        dropped = self._make_room(also_backups=False)
        if self._full:
            return False, dropped
        self.backups[block_hash_] = HostBlock(parent_hash, token_ids)
        return True, dropped

    def _make_room(self, also_backups: bool) -> list[int]:
        dropped: list[int] = []
        while self._full and (self.blocks or (also_backups and self.backups)):
            held = self.blocks if self.blocks else self.backups
            value = held.popitem(last=False)[0]
            self.arrived.pop(value, None)
            dropped.append(value)
        return dropped

    def match(self, parent_hash: int, token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[int]:
        """Hashes of the leading full blocks of ``token_ids`` (they continue the chain ending at
        ``parent_hash``) held here, at most ``max_blocks``; looked up, not taken."""
        found: list[int] = []
        for index in range(min(max_blocks, len(token_ids) // block_size)):
            key = tuple(token_ids[index * block_size:(index + 1) * block_size])
            value = block_hash(parent_hash, key)
            held = self.blocks.get(value)
            if held is None or held.token_ids != key or held.parent_hash != parent_hash:
                break
            found.append(value)
            parent_hash = value
        return found

    def take(self, hashes: Sequence[int]) -> None:
        """These blocks go back to the GPU pool (their slots free once the plan is applied)."""
        for value in hashes:
            del self.blocks[value]
            self.arrived.pop(value, None)
        self.num_taken += len(hashes)

    def put_back(self, block_hash_: int, block: HostBlock) -> None:
        """A block taken this pass left the GPU pool again before the plan went out: as if never taken."""
        self.blocks[block_hash_] = block
        self.num_taken -= 1

    def discard(self, block_hash_: int) -> bool:
        """Drop a block (its content was cached again on the GPU); whether it was here."""
        self.arrived.pop(block_hash_, None)
        return self.blocks.pop(block_hash_, None) is not None

    def stamp(self, hashes: Iterable[int], step_id: int) -> None:
        """These blocks' copies are named by plan ``step_id``."""
        for value in hashes:
            if value in self.blocks or value in self.backups:
                self.arrived[value] = step_id

    def resume(self, trusted_below: int) -> list[int]:
        """After a worker restart: the backups become host blocks (the GPU's copies are gone), and
        every block whose copy a plan of step id ``trusted_below`` or later named is dropped (it may
        be incomplete). Returns the hashes dropped."""
        for value in reversed(self.backups):  # leaves first, as evictions come
            self.blocks[value] = self.backups[value]
        self.backups.clear()
        doubtful = [value for value in self.blocks if self.arrived.get(value, trusted_below) >= trusted_below]
        for value in doubtful:
            del self.blocks[value]
            self.arrived.pop(value, None)
        self.num_taken = 0
        return doubtful

    def end_pass(self) -> None:
        self.num_taken = 0

    def check_invariants(self) -> None:
        if len(self.blocks) + len(self.backups) + self.num_taken > self.capacity:
            raise AssertionError(f"host tier holds {len(self.blocks)} + {len(self.backups)} backups + "
                                 f"{self.num_taken} taken > {self.capacity}")
        both = set(self.blocks) & set(self.backups)
        if both:
            raise AssertionError(f"blocks both host-only and backed up: {sorted(both)[:8]}")
