"""The KV-cache manager: owns the block pool, every request's block table and the prefix cache's
blocks (block hash -> block id).

It sits in the step pipeline between the scheduler and the workers. The scheduler decides how many
blocks each request holds and, with prefix caching, which token blocks are hit, cached and evicted
(``block_ledger`` says why the decisions live there); this actor decides which blocks: it frees
those of departed requests, evicts, puts cache hits at the front of new tables, appends fresh
blocks, records blocks as cached, checks every instruction against its own state, publishes the
block events, and forwards the plan with the appended block ids to the workers. It never reads a
new request's sampling parameters: over the wire it decodes plans as ``PassThroughPlan`` (those
fields stay raw msgpack and are forwarded untouched); in one process it gets the plain plan.

A block's reference count is the number of tables holding it, plus one while it is cached: a
cached block nobody holds (count 1) is idle, kept for later hits until evicted; only private
blocks (never shared) return to the free list when a request departs.

With a host tier (``host_pool``) evicted blocks move to host slots, and restored ones come back
into fresh GPU blocks; the plan forwarded to the workers names the copies (BLOCK_OFFLOADED,
BLOCK_RESTORED; a block the host tier drops is a BLOCK_EVICTED of tier "host").

A ``reset`` plan (the pipeline restarts: this actor, a worker or the scheduler was restarted)
first drops every table, cached block and reference - a fresh pool of the same size - publishing
FREED for each table dropped, BLOCK_EVICTED for the cached blocks (deepest first, so a mirror of
the cache built from the events stays exact) and KV_POOL; the plan goes on to the workers with
``reset`` set. Plans with a step id below the last reset plan's were planned before it and are
dropped unapplied. A plan with ``kv_rejoin`` (a KV-parallel rank restarted alone) goes on with
each named request's whole table filled in, as it stands before the plan's own allocations.
An engine command (``EngineControl``: sleep, wake-up, the profiler) goes on to
the workers as it came, in order with the plans.
Pure state machine: no sockets, no clock.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_actors.actors.kv_cache_manager.block_pool import BlockPool
from vllm_actors.actors.kv_cache_manager.cache_entry import CacheEntry
from vllm_actors.actors.kv_cache_manager.host_pool import HostPool
from vllm_actors.actors.kv_cache_manager.plan_checks import PlanChecks
from vllm_actors.protocol.block_hash import ROOT_HASH
from vllm_actors.protocol.events import (
    Allocated,
    BlockCached,
    BlockEvicted,
    Freed,
    KvLent,
    KvPool,
    KvReturned,
    PrefixHit,
)
from vllm_actors.protocol.messages import EngineControl, Message, NewRequest, StepPlan
from vllm_actors.protocol.names import KV_CACHE_MANAGER, WORKER
from vllm_actors.protocol.outputs import Outputs


class KVCacheManager(PlanChecks):
    name = KV_CACHE_MANAGER

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0, kv_parallel_size: int = 1) -> None:
        """``num_host_blocks``: slots of the host tier (0: none); ``kv_parallel_size``: the ranks
        the pool spreads over (``block_pool``: a request's blocks interleaved over them)."""
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, kv_parallel_size)
        self.host = HostPool(num_host_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached_front: dict[str, int] = {}  # leading blocks of each table that are cached
        self.cached: dict[int, CacheEntry] = {}  # block hash -> its block
        self.hash_of: dict[int, int] = {}  # block id -> block hash, for cached blocks
        self.num_idle_cached_blocks = 0  # cached blocks no table holds (count 1)
        # Hit chains already walked, by their last hash: requests sharing a prompt prefix hit the
        # same chain, walked once. A chain stays valid until a block is evicted (then all go).
        self._chains: dict[int, list[int]] = {}
        self.roots: dict[str, int] = {}  # request id -> the parent hash of its first block (its adapter's)
        self._last_pool: KvPool | None = None
        self._min_step_id = 0  # step id of the last reset plan: older plans are stale
        self.lent: dict[str, list[int]] = {}  # blocks reserved for other replicas' requests (kv_loans)

    def handle(self, message: Message) -> Outputs:
        if isinstance(message, EngineControl):
            outputs = Outputs()
            outputs.send(WORKER, message)
            return outputs
        if not isinstance(message, StepPlan):
            raise TypeError(f"the KV-cache manager does not take {type(message).__name__}")
        outputs = Outputs()
        if message.step_id < self._min_step_id and not message.reset:
            return outputs  # planned before the pipeline reset: nothing it names exists any more
        plan = self.assign_blocks(message, outputs.events)
        outputs.send(WORKER, plan)
        return outputs

    # ------------------------------------------------------------------ the plan
    def assign_blocks(self, plan: StepPlan, events: list[Any] | None = None) -> StepPlan:
        """Carry out a plan's block work (see ``StepPlan`` for the order) and return it with the
        new block ids filled in. Checks the whole plan first, so a bad plan changes nothing."""
        events = [] if events is None else events
        if plan.reset:
            # Checked against the empty state it will meet, first: a bad plan changes nothing.
            fresh = KVCacheManager(self.pool.num_blocks, self.block_size, self.host.num_slots, self.pool.ranks)
            if plan.keep_host_tier:
                fresh.host = self.host.resumed()
            fresh._check(plan)
            self.reset(events, keep_host=plan.keep_host_tier)
            self._min_step_id = plan.step_id
        new_requests, hit_hashes = self._check(plan)
        for request_id in plan.finished_ids:
            self._depart(request_id, events)
        for request_id, keep in plan.trimmed_blocks.items():
            self._trim(request_id, keep, events)
        rejoin = plan.kv_rejoin  # a KV-parallel rank restarted alone: every rank re-seeds these tables
        if rejoin is not None:
            rejoin = msgspec.structs.replace(rejoin, block_tables=[
                list(self.block_tables.get(new.request_id, ())) for new in rejoin.requests])
        self.host.drop(plan.host_dropped_hashes, events)
        offload_copies = self._evict(plan.evicted_hashes, set(plan.host_dropped_hashes), events)
        restore_copies = self._restore(plan.restored_hashes, events)
        lent = self._lend(plan, events)
        new_block_ids: list[list[int]] = []
        for request_id, wanted in zip(plan.req_ids, plan.num_blocks, strict=True):
            new = new_requests.get(request_id)
            hit = self._take_hit(new, hit_hashes[request_id], events) if new is not None else None
            table = self.block_tables.setdefault(request_id, [])
            added = self.pool.allocate(wanted - len(table), len(table)) if wanted > len(table) else []
            table.extend(added)
            new_block_ids.append(hit + added if hit else added)
            if added:
                events.append(Allocated(request_id=request_id, block_ids=added, num_free_blocks=self.pool.num_free))
            hashes = plan.cached_hashes.get(request_id)
            if hashes:
                self._cache(request_id, hashes, events)
        write_through = self.host.back_up(
            [(value, self.cached[value].block_id, self.cached[value].parent_hash) for value in plan.backup_hashes],
            events)
        self._report_pool(events)
        return msgspec.structs.replace(plan, new_block_ids=new_block_ids, offload_copies=offload_copies,
                                       restore_copies=restore_copies, write_through_copies=write_through,
                                       kv_rejoin=rejoin, lent_block_ids=lent)

    def reset(self, events: list[Any], keep_host: bool = False) -> None:
        """Drop every table, cached block and reference: a fresh pool of the same size. The host
        tier too, unless ``keep_host`` (a worker's restart: its memory outlived it), where the GPU's
        backed-up blocks stay cached, held by the host tier alone."""
        num_blocks = self.pool.num_blocks
        dropped = bool(self.block_tables or self.cached or self.host.entries or self.lent)
        if keep_host:
            kept = set(self.host.backups)
            self.host = self.host.resumed()
        else:
            kept = set()
            self.host.drop(list(self.host.entries), events)  # below the GPU blocks: leaves first
            self.host = HostPool(self.host.num_slots)
        for request_id, table in self.block_tables.items():
            if table:
                events.append(Freed(request_id=request_id, num_blocks=len(table), num_free_blocks=num_blocks))
        for request_id, blocks in self.lent.items():  # the lender's scheduler asks for them again
            events.append(KvReturned(request_id=request_id, num_blocks=len(blocks), num_free_blocks=num_blocks))
        if self.cached:
            depth: dict[int, int] = {ROOT_HASH: 0}

            def depth_of(block_hash_: int) -> int:
                chain = []
                while block_hash_ not in depth:
                    if block_hash_ not in self.cached:  # an adapter's root
                        depth[block_hash_] = 0
                        break
                    chain.append(block_hash_)
                    block_hash_ = self.cached[block_hash_].parent_hash
                for known in reversed(chain):
                    depth[known] = depth[block_hash_] + 1
                    block_hash_ = known
                return depth[block_hash_]

            order = sorted((h for h in self.cached if h not in kept),
                           key=lambda h: (-depth_of(h), self.cached[h].block_id))
            if order:
                events.append(BlockEvicted(block_ids=[self.cached[h].block_id for h in order], block_hashes=order,
                                           parent_hashes=[self.cached[h].parent_hash for h in order]))
        self.pool = BlockPool(num_blocks, self.pool.ranks)
        self.block_tables = {}
        self.lent = {}
        self.num_cached_front = {}
        self.cached = {}
        self.hash_of = {}
        self.num_idle_cached_blocks = 0
        self._chains = {}
        self.roots = {}
        self._last_pool = None  # the plan's end state is reported whatever it was before
        if dropped:
            self._report_pool(events)

    # ------------------------------------------------------------------ steps of a plan
    def _lend(self, plan: StepPlan, events: list[Any]) -> dict[str, list[int]]:
        """Loans to other replicas' requests: the ended ones' blocks freed, the new ones' taken
        (returned: their block ids, for the workers)."""
        for request_id in plan.returned_loans:
            blocks = self.lent.pop(request_id)
            self.pool.release(blocks)
            events.append(KvReturned(request_id=request_id, num_blocks=len(blocks), num_free_blocks=self.pool.num_free))
        for request_id, count in plan.loans.items():
            self.lent[request_id] = blocks = self.pool.allocate(count)
            events.append(KvLent(request_id=request_id, block_ids=blocks, num_free_blocks=self.pool.num_free))
        return {request_id: self.lent[request_id] for request_id in plan.loans}

    def _depart(self, request_id: str, events: list[Any]) -> None:
        table = self.block_tables.pop(request_id, [])
        front = self.num_cached_front.pop(request_id, 0)
        self.roots.pop(request_id, None)
        self.pool.release(table)  # private blocks go free, cached ones lose a holder
        self.num_idle_cached_blocks += sum(1 for block in table[:front] if self.pool.ref_count(block) == 1)
        if table:
            events.append(Freed(request_id=request_id, num_blocks=len(table), num_free_blocks=self.pool.num_free))

    def _trim(self, request_id: str, keep: int, events: list[Any]) -> None:
        """Speculative decoding: the blocks past ``keep`` (they held rejected drafts only) go free."""
        table = self.block_tables[request_id]
        tail = table[keep:]
        del table[keep:]
        self.pool.release(tail)
        if tail:
            events.append(Freed(request_id=request_id, num_blocks=len(tail), num_free_blocks=self.pool.num_free))

    def _evict(self, hashes: list[int], dropped: set[int], events: list[Any]) -> list[int]:
        """Uncache these GPU blocks: to the host tier where there is one (not the ``dropped``);
        returns the offload copies."""
        if not hashes:
            return []
        gone: list[tuple[int, int, int]] = []  # (hash, block, parent) leaving the cache
        moved: list[tuple[int, int, int]] = []  # ... moving to the host tier
        for block_hash_ in hashes:
            entry = self.cached.pop(block_hash_)
            del self.hash_of[entry.block_id]
            self.pool.release([entry.block_id])
            self.num_idle_cached_blocks -= 1
            to_host = self.host.num_slots and block_hash_ not in dropped
            (moved if to_host else gone).append((block_hash_, entry.block_id, entry.parent_hash))
        if gone:
            gone_hashes, ids, parents = (list(column) for column in zip(*gone, strict=True))
            events.append(BlockEvicted(block_ids=ids, block_hashes=gone_hashes, parent_hashes=parents))
        return self.host.offload(moved, events)

    def _restore(self, hashes: list[int], events: list[Any]) -> list[int]:
        """Host blocks back into fresh GPU blocks, cached and idle; returns the restore copies."""
        if not hashes:
            return []
        taken = self.host.take(hashes)
        blocks = sorted(self.pool.allocate(len(hashes)))  # its one reference is the cache's
        for block_hash_, entry, block in zip(hashes, taken, blocks, strict=True):
            self.cached[block_hash_] = CacheEntry(block_id=block, parent_hash=entry.parent_hash)
            self.hash_of[block] = block_hash_
        self.num_idle_cached_blocks += len(blocks)
        return self.host.restored([entry.slot for entry in taken], blocks, events)

    def _take_hit(self, new: NewRequest, hashes: list[int], events: list[Any]) -> list[int]:
        """A new request's cached blocks (``hashes``, checked), now at the front of its table."""
        cached = self.cached
        blocks = [cached[block_hash_].block_id for block_hash_ in hashes]
        self.num_idle_cached_blocks -= sum(1 for block in blocks if self.pool.ref_count(block) == 1)
        self.pool.share(blocks)
        self.block_tables[new.request_id] = list(blocks)
        self.num_cached_front[new.request_id] = len(blocks)
        if new.lora_request is not None:
            self.roots[new.request_id] = new.root_hash
        if blocks:
            events.append(
                PrefixHit(
                    request_id=new.request_id,
                    num_cached_tokens=new.num_cached_tokens,
                    block_ids=blocks,
                    block_hashes=hashes,
                )
            )
        return blocks

    def _cache(self, request_id: str, hashes: list[int], events: list[Any]) -> None:
        """The table's blocks right after the cached front are cached under these hashes."""
        table = self.block_tables[request_id]
        front = self.num_cached_front.get(request_id, 0)
        if front + len(hashes) > len(table):
            raise ValueError(f"{request_id!r} caches {front + len(hashes)} blocks but holds {len(table)}")
        parent = self.hash_of[table[front - 1]] if front else self.roots.get(request_id, ROOT_HASH)
        first_parent = parent
        blocks = table[front : front + len(hashes)]
        for block, block_hash_ in zip(blocks, hashes, strict=True):
            if block_hash_ in self.cached:
                raise ValueError(f"block hash {block_hash_} is cached twice")
            self.cached[block_hash_] = CacheEntry(block_id=block, parent_hash=parent)
            self.hash_of[block] = block_hash_
            parent = block_hash_
        self.pool.share(blocks)  # the cache's own reference
        self.num_cached_front[request_id] = front + len(hashes)
        events.append(
            BlockCached(request_id=request_id, parent_hash=first_parent, block_ids=blocks, block_hashes=list(hashes))
        )

    def _report_pool(self, events: list[Any]) -> None:
        idle = self.num_idle_cached_blocks
        pool = KvPool(
            num_blocks=self.pool.num_blocks,
            num_free=self.pool.num_free,
            num_cached=len(self.cached),
            num_cached_idle=idle,
            num_in_use=self.pool.num_blocks - self.pool.num_free - idle,
        )
        if pool != self._last_pool:
            events.append(pool)
            self._last_pool = pool

    # ------------------------------------------------------------------ checks
    # the plan's (_check, _chain): plan_checks.py
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def check_invariants(self, live_request_ids: set[str] | None = None) -> None:
        """free + cached + private == total; a block's count is its holders plus one if cached;
        no block both free and referenced; each table is cached blocks (a chain from the root)
        then private ones; no table of a dead request."""
        free = self.pool.free_blocks()
        if len(free) != len(set(free)):
            raise AssertionError("a block is on the free list twice")
        holders = [0] * self.pool.num_blocks
        for table in [*self.block_tables.values(), *self.lent.values()]:
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
