"""The scheduler's ledger of the KV pool: free blocks, what each request holds, and the prefix
cache's content (which token blocks are cached, shared, idle).

Why the scheduler keeps the prefix tree. How many prompt tokens a request may skip decides how
much of the step's token budget and how many blocks its admission takes, and requests admitted
in the same planning pass must see each other's blocks (256 requests sharing a system prompt
arrive together: the first computes it, the others should not). So the lookup has to happen inside
the scheduler's pass, with no round trip. The scheduler has the token ids; the KV-cache manager
has the block ids. Split accordingly: this ledger decides (hits, blocks cached as they fill,
least-recently-used evictions), with the tree's block ids as mere labels; the step plan carries
each decision (``NewRequest.num_cached_tokens``, ``StepPlan.cached_hashes``,
``StepPlan.evicted_hashes``) and the KV-cache manager applies it to real blocks by block hash,
checks it, and publishes the block events. Content, never labels, crosses the wire.

Pure bookkeeping: no I/O, no clock, no torch.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_actors.actors.scheduler.prefix_cache import PrefixCache


class LedgerError(RuntimeError):
    """The scheduler asked for more than the pool has: a bug in its accounting."""


@dataclass
class Holding:
    """The blocks of one request: ``cached`` (labels of the cached blocks at the front of its
    table, each holding one reference) then private blocks, ``num_blocks`` in all."""

    num_blocks: int = 0
    cached: list[int] = field(default_factory=list)
    stopped: bool = False  # a block of it was already cached under another id: cache no more


class BlockLedger:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.total = num_blocks
        self.block_size = block_size
        self.cache: PrefixCache | None = PrefixCache(block_size) if enable_caching else None
        self.num_free = num_blocks  # blocks neither cached nor held
        self._holdings: dict[str, Holding] = {}
        self._labels = itertools.count()
        self._evicted: list[int] = []  # hashes evicted since the last plan

    # ------------------------------------------------------------------ queries
    @property
    def num_available(self) -> int:
        """Blocks a request could get now: free ones plus idle cached ones (evicted on demand)."""
        return self.num_free + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_cached(self) -> int:
        return self.cache.num_cached if self.cache else 0

    def num_blocks(self, request_id: str) -> int:
        holding = self._holdings.get(request_id)
        return holding.num_blocks if holding else 0

    def blocks_missing(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request must get to hold ``num_tokens`` tokens (0 or less: it holds enough)."""
        return -(-num_tokens // self.block_size) - self.num_blocks(request_id)

    def next_cache_check(self, request_id: str) -> int:
        """Computed tokens from which ``cache_blocks`` could cache another block of the request
        (one more full block than its cached front); never again once it stopped."""
        holding = self._holdings[request_id]
        if self.cache is None or holding.stopped:
            return sys.maxsize
        return (len(holding.cached) + 1) * self.block_size

    def cached_prefix_blocks(self, token_ids: Sequence[int]) -> int:
        """Blocks a lookup of ``token_ids`` would hit now, without touching the LRU order."""
        if self.cache is None:
            return 0
        return self.cache.match_length(token_ids, self._max_hit(len(token_ids)))

    # ------------------------------------------------------------------ changes
    def admit(self, request_id: str, token_ids: Sequence[int] | None) -> tuple[int, int]:
        """A request starts holding blocks. With ``token_ids`` (None: no lookup), it takes the
        longest cached prefix of them, leaving at least one token to compute. Returns the number
        of blocks hit, now at the front of its table, and the hash of the last (0: none)."""
        if request_id in self._holdings:
            raise LedgerError(f"request {request_id!r} already holds blocks")
        holding = Holding()
        self._holdings[request_id] = holding
        if self.cache is None or token_ids is None:
            return 0, 0
        holding.cached = self.cache.take(token_ids, self._max_hit(len(token_ids)))
        holding.num_blocks = len(holding.cached)
        last = self.cache.block_hash_of(holding.cached[-1]) if holding.cached else 0
        return len(holding.cached), last

    def allocate(self, request_id: str, count: int) -> None:
        """Append ``count`` private blocks to a request, evicting idle cached blocks (least
        recently used first) when too few are free."""
        if count <= 0:
            return
        if count > self.num_available:
            raise LedgerError(f"asked for {count} blocks, {self.num_available} available")
        if count > self.num_free:
            assert self.cache is not None
            evicted = self.cache.evict(count - self.num_free)
            self._evicted.extend(block.block_hash for block in evicted)
            self.num_free += len(evicted)
        self.num_free -= count
        self._holdings[request_id].num_blocks += count

    def cache_blocks(self, request_id: str, num_full: int, tokens: Callable[[int, int], Sequence[int]]) -> list[int]:
        """Cache the request's first ``num_full`` blocks (their KV computed by now or by the step
        being planned; ``tokens(start, end)`` gives their token ids). Only blocks past its cached
        front are looked at. Returns the hashes of the blocks newly cached, in table order."""
        holding = self._holdings[request_id]
        start = len(holding.cached)
        if self.cache is None or holding.stopped or num_full <= start:
            return []
        if num_full > holding.num_blocks:
            raise LedgerError(f"{request_id!r} caches {num_full} blocks but holds {holding.num_blocks}")
        size = self.block_size
        labels = [next(self._labels) for _ in range(num_full - start)]
        parent = holding.cached[-1] if holding.cached else None
        new = self.cache.extend(parent, tokens(start * size, num_full * size), labels)
        if len(new) < len(labels):
            holding.stopped = True  # another request cached the same content first
        holding.cached.extend(block.block_id for block in new)
        return [block.block_hash for block in new]

    def release(self, request_id: str) -> None:
        """The request holds nothing any more: private blocks are free, cached ones lose a
        reference (idle once nobody holds them, kept for later hits)."""
        holding = self._holdings.pop(request_id, None)
        if holding is None:
            return
        if holding.cached:
            assert self.cache is not None
            self.cache.release(holding.cached)
        self.num_free += holding.num_blocks - len(holding.cached)

    def evict_idle(self) -> int:
        """Evict every cached block no request holds (a prefix-cache reset); how many."""
        if self.cache is None:
            return 0
        evicted = self.cache.evict(self.cache.num_evictable)
        self._evicted.extend(block.block_hash for block in evicted)
        self.num_free += len(evicted)
        return len(evicted)

    @property
    def has_evicted(self) -> bool:
        """Evictions the next plan must carry."""
        return bool(self._evicted)

    def take_evicted(self) -> list[int]:
        """Hashes evicted since the last call, in eviction order (for the next plan)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    # ------------------------------------------------------------------ checks
    def check_invariants(self, live_request_ids: set[str] | None = None) -> None:
        """free + cached + private == total; free never negative; no holding of a dead request;
        the tree consistent, and its references exactly the holdings' cached fronts."""
        private = sum(holding.num_blocks - len(holding.cached) for holding in self._holdings.values())
        if self.num_free < 0 or private < 0:
            raise AssertionError(f"negative count: free {self.num_free}, private {private}")
        if self.num_free + self.num_cached + private != self.total:
            raise AssertionError(
                f"free ({self.num_free}) + cached ({self.num_cached}) + private ({private}) != total ({self.total})"
            )
        if live_request_ids is not None:
            stale = set(self._holdings) - live_request_ids
            if stale:
                raise AssertionError(f"blocks held by finished requests: {sorted(stale)[:8]}")
        if self.cache is None:
            return
        self.cache.check_invariants()
        references: dict[int, int] = {}
        for holding in self._holdings.values():
            for label in holding.cached:
                references[label] = references.get(label, 0) + 1
        cached = self.cache.cached_block_ids()
        if not set(references) <= cached:
            raise AssertionError(f"requests hold uncached blocks {sorted(set(references) - cached)[:8]}")
        for label in cached:
            if self.cache.ref_count(label) != references.get(label, 0):
                raise AssertionError(
                    f"cached block {label} has {self.cache.ref_count(label)} references, "
                    f"{references.get(label, 0)} requests hold it"
                )

    def _max_hit(self, num_tokens: int) -> int:
        # At least one token is computed: the step must produce the logits to sample from.
        return (num_tokens - 1) // self.block_size
