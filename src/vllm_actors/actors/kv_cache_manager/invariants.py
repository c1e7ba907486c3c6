"""The KV-cache manager's invariants, checked on demand (``--check-invariants``, tests): the pool's
reference counts, the cache's two indexes, each table's cached front (``KVCacheManager`` mixes
this in)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_actors.actors.kv_cache_manager.block_pool import BlockPool
from vllm_actors.actors.kv_cache_manager.cache_entry import CacheEntry
from vllm_actors.actors.kv_cache_manager.host_pool import HostPool
from vllm_actors.protocol.block_hash import ROOT_HASH


class Invariants:
    """``check_invariants`` of ``KVCacheManager``."""

    if TYPE_CHECKING:  # provided by KVCacheManager
        pool: BlockPool
        host: HostPool
        block_tables: dict[str, list[int]]
        num_cached_front: dict[str, int]
        cached: dict[int, CacheEntry]
        hash_of: dict[int, int]
        roots: dict[str, int]
        num_idle_cached_blocks: int

    def check_invariants(self, live_request_ids: set[str] | None = None) -> None:
        """free + cached + private == total; a block's count is its holders plus one if cached;
        no block both free and referenced; each table is cached blocks (a chain from the root)
        then private ones; no table of a dead request."""
        free = self.pool.free_blocks()
        if len(free) != len(set(free)):
            raise AssertionError("a block is on the free list twice")
        holders = [0] * self.pool.num_blocks
        for table in self.block_tables.values():
            for block in table:
                holders[block] += 1
        for block in range(self.pool.num_blocks):
            expected = holders[block] + (block in self.hash_of)
            if self.pool.ref_count(block) != expected:
                raise AssertionError(f"block {block} has count {self.pool.ref_count(block)}, expected {expected}")
        referenced = {block for block in range(self.pool.num_blocks) if self.pool.ref_count(block) > 0}
        if referenced & set(free):
            raise AssertionError(f"blocks both free and referenced: {sorted(referenced & set(free))[:8]}")
        private = referenced - set(self.hash_of)
        if len(free) + len(self.cached) + len(private) != self.pool.num_blocks:
            raise AssertionError(
                f"free ({len(free)}) + cached ({len(self.cached)}) + private ({len(private)}) "
                f"!= total ({self.pool.num_blocks})"
            )
        self.host.check_invariants(set(self.cached))
        idle = sum(1 for entry in self.cached.values() if self.pool.ref_count(entry.block_id) == 1)
        if idle != self.num_idle_cached_blocks:
            raise AssertionError(f"{idle} idle cached blocks, counted {self.num_idle_cached_blocks}")
        if any(self.cached[block_hash_].block_id != block for block, block_hash_ in self.hash_of.items()):
            raise AssertionError("the hash index and the block index disagree")
        for request_id, table in self.block_tables.items():
            front = self.num_cached_front.get(request_id, 0)
            parent = self.roots.get(request_id, ROOT_HASH)
            for position, block in enumerate(table):
                cached = block in self.hash_of
                if cached != (position < front):
                    raise AssertionError(
                        f"{request_id!r}: block {position} of {len(table)} breaks the cached front {front}"
                    )
                if cached:
                    if self.cached[self.hash_of[block]].parent_hash != parent:
                        raise AssertionError(f"{request_id!r}: cached block {position} is not under its predecessor")
                    parent = self.hash_of[block]
                elif holders[block] != 1:
                    raise AssertionError(f"private block {block} is shared")
        if live_request_ids is not None:
            stale = set(self.block_tables) - live_request_ids
            if stale:
                raise AssertionError(f"blocks still referenced by finished requests: {sorted(stale)}")
