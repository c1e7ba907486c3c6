"""What the KV-cache manager refuses in a plan: each instruction checked against its state before
anything changes (``MessageRejected``), and the hash chains of the new requests' cache hits
(``KVCacheManager`` mixes this in)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm_actors.actors.kv_cache_manager.block_pool import BlockPool
from vllm_actors.actors.kv_cache_manager.cache_entry import CacheEntry
from vllm_actors.actors.kv_cache_manager.host_pool import HostPool
from vllm_actors.protocol.block_hash import ROOT_HASH
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.messages import NewRequest, StepPlan


class PlanChecks:
    """The plan check of ``KVCacheManager``."""

    if TYPE_CHECKING:  # provided by KVCacheManager
        block_size: int
        pool: BlockPool
        host: HostPool
        block_tables: dict[str, list[int]]
        num_cached_front: dict[str, int]
        cached: dict[int, CacheEntry]
        hash_of: dict[int, int]
        roots: dict[str, int]
        _chains: dict[int, list[int]]
        lent: dict[str, list[int]]

    def _check(self, plan: StepPlan) -> tuple[dict[str, NewRequest], dict[str, list[int]]]:
        """Reject a plan this state cannot carry out (``MessageRejected``), before anything
        changes. Returns the new requests by id and the hash chains of their cache hits."""
        if len(plan.req_ids) != len(plan.num_blocks):
            raise MessageRejected("req_ids and num_blocks differ in length")
        if not set(plan.cached_hashes) <= set(plan.req_ids):
            raise MessageRejected("cached_hashes names a request that is not scheduled")
        if len(set(plan.req_ids)) != len(plan.req_ids):
            raise MessageRejected("a request is scheduled twice")
        new_requests = {new.request_id: new for new in plan.new_requests}
        if not set(new_requests) <= set(plan.req_ids):
            raise MessageRejected("a new request is not scheduled")
        departing = set(plan.finished_ids)
        evicted = set(plan.evicted_hashes)
        if any(h in self.cached and h not in evicted for h in plan.restored_hashes):
            raise MessageRejected("the plan restores a block that is cached on the GPU")
        if evicted:
            self._chains.clear()  # a memo only: dropping it changes nothing but speed
        if len(evicted) != len(plan.evicted_hashes):
            raise MessageRejected("a block is evicted twice")
        for block_hash_ in plan.evicted_hashes:
            entry = self.cached.get(block_hash_)
            if entry is None:
                raise MessageRejected(f"plan evicts block hash {block_hash_}, which is not cached")
            holders = self.pool.ref_count(entry.block_id) - 1
            released = sum(
                self.block_tables[request_id].count(entry.block_id)
                for request_id in departing
                if request_id in self.block_tables
            )
            if holders - released > 0:
                raise MessageRejected(f"plan evicts block {entry.block_id} while a request holds it")
        restored_parents = self.host.check(plan, {h: self.cached[h].parent_hash for h in plan.evicted_hashes},
                                           {h for hashes in plan.cached_hashes.values() for h in hashes})
        freed = len(plan.evicted_hashes) + sum(
            len(self.block_tables.get(request_id, ())) - self.num_cached_front.get(request_id, 0)
            for request_id in departing
        )
        for request_id, keep in plan.trimmed_blocks.items():
            table = self.block_tables.get(request_id)
            if table is None or request_id in departing:
                raise MessageRejected(f"plan trims {request_id!r}, which holds no blocks here")
            if not self.num_cached_front.get(request_id, 0) <= keep <= len(table):
                raise MessageRejected(f"plan trims {request_id!r} to {keep} of its {len(table)} blocks")
            freed += len(table) - keep
        loan_freed, loan_needed = self._loans(plan)
        freed += loan_freed

        def parent_of(block_hash_: int) -> int | None:
            """The block's parent hash if it is cached at this point of the plan, else None."""
            if block_hash_ in cached_now:
                return cached_now[block_hash_]
            entry = self.cached.get(block_hash_)
            return None if entry is None or block_hash_ in evicted else entry.parent_hash

        # cached by requests earlier in this plan (or restored from the host first): hash -> parent
        cached_now: dict[int, int] = dict(restored_parents)
        hit_hashes: dict[str, list[int]] = {}  # shared lists: read only
        needed = len(restored_parents) + loan_needed
        for request_id, wanted in zip(plan.req_ids, plan.num_blocks, strict=True):
            new = new_requests.get(request_id)
            if new is not None:
                if request_id in self.block_tables and request_id not in departing:
                    raise MessageRejected(f"new request {request_id!r} already has a block table")
                if new.num_cached_tokens % self.block_size or not 0 <= new.num_cached_tokens < new.num_tokens:
                    raise MessageRejected(f"new request {request_id!r} has a bad num_cached_tokens")
                held = new.num_cached_tokens // self.block_size
                front = held
                chain = self._chains.get(new.cached_block_hash)
                if chain is None or len(chain) != held:
                    chain = self._chain(new.cached_block_hash, held, parent_of, new.root_hash)
                    if chain is not None and held:
                        self._chains[new.cached_block_hash] = chain
                if chain is None:
                    raise MessageRejected(f"plan gives {request_id!r} a cache hit on blocks that are not cached")
                hit_hashes[request_id] = chain
                parent = chain[-1] if chain else new.root_hash
            else:
                if request_id not in self.block_tables or request_id in departing:
                    raise MessageRejected(f"plan schedules {request_id!r}, which holds no blocks here")
                held = plan.trimmed_blocks.get(request_id, len(self.block_tables[request_id]))
                front = self.num_cached_front.get(request_id, 0)
                parent = (self.hash_of[self.block_tables[request_id][front - 1]] if front
                          else self.roots.get(request_id, ROOT_HASH))
            hashes = plan.cached_hashes.get(request_id, [])
            if front + len(hashes) > max(wanted, held):
                raise MessageRejected(f"plan caches more blocks of {request_id!r} than it holds")
            if any(parent_of(h) is not None for h in hashes) or len(set(hashes)) != len(hashes):
                raise MessageRejected(f"plan caches a block of {request_id!r} that is already cached")
            for block_hash_ in hashes:
                cached_now[block_hash_] = parent
                parent = block_hash_
            needed += max(wanted - held, 0)
        if needed > self.pool.num_free + freed:
            raise MessageRejected(f"the plan needs {needed} blocks, {self.pool.num_free + freed} free")
        return new_requests, hit_hashes

    def _loans(self, plan: StepPlan) -> tuple[int, int]:
        """Blocks the plan's returned loans free and its new loans take (lent to other replicas)."""
        returned = set(plan.returned_loans)
        if len(returned) != len(plan.returned_loans) or not returned <= set(self.lent):
            raise MessageRejected("plan returns a loan twice or one that was never lent")
        for request_id, count in plan.loans.items():
            if count < 1 or (request_id in self.lent and request_id not in returned):
                raise MessageRejected(f"plan lends {count} blocks for {request_id!r}, which is lent already or < 1")
        return sum(len(self.lent[request_id]) for request_id in returned), sum(plan.loans.values())

    @staticmethod
    def _chain(last: int, length: int, parent_of: Callable[[int], int | None], root: int) -> list[int] | None:
        """The hashes from the root (``root``: its adapter's) down to ``last``, if that is a chain
        of ``length`` cached blocks; None otherwise."""
        if length == 0:
            return [] if last == ROOT_HASH else None
        chain = [last]
        while len(chain) <= length:
            parent = parent_of(chain[-1])
            if parent is None:
                return None
            if parent == root:
                break
            chain.append(parent)
        if len(chain) != length:
            return None
        chain.reverse()
        return chain
