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
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_actors.actors.scheduler.host_tier import HostBlock, HostTier
from vllm_actors.actors.scheduler.prefix_cache import CachedBlock, PrefixCache
from vllm_actors.protocol.block_hash import root_hash
from vllm_actors.protocol.write_through import LAG


class LedgerError(RuntimeError):
    """The scheduler asked for more than the pool has: a bug in its accounting."""


@dataclass
class Holding:
    """The blocks of one request: ``cached`` (labels of the cached blocks at the front of its
    table, each holding one reference) then private blocks, ``num_blocks`` in all."""

    num_blocks: int = 0
    cached: list[int] = field(default_factory=list)
    stopped: bool = False  # a block of it was already cached under another id: cache no more
    lora_int_id: int = 0  # its LoRA adapter: its blocks are cached in that adapter's tree
    lent_front: int = 0  # the front of its table held by other replicas (borrowed KV): not counted here


class BlockLedger:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, num_host_blocks: int = 0,
                 write_through_tokens: int = 0, first_step_id: int = 0) -> None:
        """``num_host_blocks``: the host KV tier's size (0: none; it needs ``enable_caching``);
        ``write_through_tokens``: prompts this long have their blocks copied there as they are
        cached (0: none); ``first_step_id``: the step id of the first plan built on this ledger."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.total = num_blocks
        self.block_size = block_size
        self.cache: PrefixCache | None = PrefixCache(block_size) if enable_caching else None
        self.num_free = num_blocks  # blocks neither cached nor held
        self._holdings: dict[str, Holding] = {}
        self._labels = itertools.count()
        self._evicted: list[int] = []  # hashes evicted since the last plan
        self.host = HostTier(num_host_blocks) if enable_caching and num_host_blocks > 0 else None
        self._host_dropped: dict[int, None] = {}  # since the last plan, in order: StepPlan.host_dropped_hashes
        self._restored: dict[int, HostBlock] = {}  # since the last plan, parents first
        self.write_through_tokens = write_through_tokens if self.host is not None else 0
        self._backups: dict[int, None] = {}  # backed up since the last plan: StepPlan.backup_hashes
        self._arrivals: list[int] = []  # copied to the host tier since the last plan (stamped with its step)
        self._first_step_id = first_step_id
        self._launched: deque[int] = deque(maxlen=LAG)  # step ids of the last results of plans that ran a step
        self.host_resumed = False  # the host tier outlived a worker restart (the reset plan keeps it)

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

    def num_cached_front(self, request_id: str) -> int:
        """Leading blocks of the request's table that are cached (their KV computed or planned)."""
        holding = self._holdings.get(request_id)
        return len(holding.cached) if holding else 0

    def blocks_missing(self, request_id: str, num_tokens: int) -> int:
        """Blocks the request must get to hold ``num_tokens`` tokens (0 or less: it holds enough)."""
        holding = self._holdings.get(request_id)
        held = holding.num_blocks + holding.lent_front if holding else 0
        return -(-num_tokens // self.block_size) - held

    def next_cache_check(self, request_id: str) -> int:
        """Computed tokens from which ``cache_blocks`` could cache another block of the request
        (one more full block than its cached front); never again once it stopped."""
        holding = self._holdings[request_id]
        if self.cache is None or holding.stopped:
            return sys.maxsize
        return (len(holding.cached) + 1) * self.block_size

    def cached_prefix_blocks(self, token_ids: Sequence[int], lora_int_id: int = 0) -> int:
        """Blocks a lookup of ``token_ids`` would hit now, without touching the LRU order."""
        if self.cache is None:
            return 0
        return self.cache.match_length(token_ids, self._max_hit(len(token_ids)), lora_int_id)

    # ------------------------------------------------------------------ changes
    def admit(self, request_id: str, token_ids: Sequence[int] | None, lora_int_id: int = 0,
              lent_front: int = 0) -> tuple[int, int]:
        """A request starts holding blocks. With ``token_ids`` (None: no lookup), it takes the
        longest cached prefix of them (in its adapter's tree), leaving at least one token to
        compute. Returns the number of blocks hit, now at the front of its table, and the hash of
        the last (0: none). ``lent_front``: its table's first blocks are other replicas' (borrowed KV)."""
        if request_id in self._holdings:
            raise LedgerError(f"request {request_id!r} already holds blocks")
        holding = Holding(lora_int_id=lora_int_id, lent_front=lent_front, stopped=lent_front > 0)  # never cached
        self._holdings[request_id] = holding
        if self.cache is None or token_ids is None:
            return 0, 0
        holding.cached = self.cache.take(token_ids, self._max_hit(len(token_ids)), lora_int_id)
        holding.num_blocks = len(holding.cached)
        if self.host is not None:
            self._restore(holding, token_ids)
        last = self.cache.block_hash_of(holding.cached[-1]) if holding.cached else 0
        return len(holding.cached), last

    def allocate(self, request_id: str, count: int) -> None:
        """Append ``count`` private blocks to a request, evicting idle cached blocks (least
        recently used first) when too few are free."""
        if count <= 0:
            return
        if count > self.num_available:
            raise LedgerError(f"asked for {count} blocks, {self.num_available} available")
        self._make_free(count)
        self.num_free -= count
        self._holdings[request_id].num_blocks += count

    def _make_free(self, count: int) -> None:
        """Evict idle cached blocks until ``count`` blocks are free (to the host tier, if any)."""
        if count > self.num_free:
            assert self.cache is not None
            evicted = self.cache.evict(count - self.num_free)
            self.num_free += len(evicted)
            if self.host is None:
                self._evicted.extend(block.block_hash for block in evicted)
            else:
                self._offload(evicted)

    def _offload(self, evicted: list[CachedBlock]) -> None:
        assert self.host is not None
        for block in evicted:
            taken = self._restored.pop(block.block_hash, None)
            if taken is not None:  # taken back this pass and evicted again: the plan never moves it
                self.host.put_back(block.block_hash, taken)
                continue
            self._evicted.append(block.block_hash)
            self._host_dropped.pop(block.block_hash, None)  # cached again on the GPU and evicted again
            backed_up = block.block_hash in self.host.backups  # already there: it stays, uncopied
            kept, dropped = self.host.offer(block.block_hash, block.parent_hash, block.token_ids)
            self._drop_from_host(dropped)
            if not kept:
                self._host_dropped[block.block_hash] = None
            elif not backed_up:
                self._arrivals.append(block.block_hash)

    def _drop_from_host(self, hashes: list[int]) -> None:
        """Blocks the host tier dropped: the next plan says so (a backup of this pass is just not made)."""
        for value in hashes:
            if self._backups.pop(value, 0) is None:
                continue
            self._host_dropped[value] = None

    def _restore(self, holding: Holding, token_ids: Sequence[int]) -> None:
        """Past its GPU hit, a request takes the blocks of its prompt held in the host tier back
        (as many as the GPU pool can give): cached on the GPU again, held by the request."""
        assert self.host is not None and self.cache is not None
        size = self.block_size
        start = len(holding.cached)
        parent = self.cache.block_hash_of(holding.cached[-1]) if holding.cached else root_hash(holding.lora_int_id)
        limit = min(self._max_hit(len(token_ids)) - start, self.num_available)
        hashes = self.host.match(parent, token_ids[start * size:], size, limit)
        if not hashes:
            return
        for value in hashes:
            self._restored[value] = self.host.blocks[value]
        self.host.take(hashes)
        self._make_free(len(hashes))  # the request's GPU hit is held: never evicted here
        self.num_free -= len(hashes)
        labels = [next(self._labels) for _ in hashes]
        tokens = token_ids[start * size:(start + len(hashes)) * size]
        new = self.cache.extend(holding.cached[-1] if holding.cached else None, tokens, labels, holding.lora_int_id)
        assert len(new) == len(hashes), "a host block's content is also cached on the GPU"
        holding.cached.extend(labels)
        holding.num_blocks += len(labels)

    def writes_through(self, num_prompt_tokens: int) -> bool:
        """Whether a prompt this long has its blocks copied to the host tier as they are cached."""
        return 0 < self.write_through_tokens <= num_prompt_tokens

    def cache_blocks(self, request_id: str, num_full: int, tokens: Callable[[int, int], Sequence[int]],
                     back_up: bool = False) -> list[int]:
        """Cache the request's first ``num_full`` blocks (their KV computed by now or by the step
        being planned; ``tokens(start, end)`` gives their token ids). Only blocks past its cached
        front are looked at. Returns the hashes of the blocks newly cached, in table order.
        ``back_up``: they are also copied to the host tier (as room allows), after the step."""
        holding = self._holdings[request_id]
        start = len(holding.cached)
        if self.cache is None or holding.stopped or num_full <= start:
            return []
        if num_full > holding.num_blocks:
            raise LedgerError(f"{request_id!r} caches {num_full} blocks but holds {holding.num_blocks}")
        size = self.block_size
        labels = [next(self._labels) for _ in range(num_full - start)]
        parent = holding.cached[-1] if holding.cached else None
        new = self.cache.extend(parent, tokens(start * size, num_full * size), labels, holding.lora_int_id)
        if len(new) < len(labels):
            holding.stopped = True  # another request cached the same content first
        if self.host is not None:  # content back on the GPU: its host copy is a duplicate
            self._host_dropped.update(dict.fromkeys(block.block_hash for block in new
                                                    if self.host.discard(block.block_hash)))
            if back_up:
                for block in new:
                    kept, dropped = self.host.back_up(block.block_hash, block.parent_hash, block.token_ids)
                    self._host_dropped.update(dict.fromkeys(dropped))
                    if not kept:
                        break
                    self._backups[block.block_hash] = None
                    self._arrivals.append(block.block_hash)
        holding.cached.extend(block.block_id for block in new)
        return [block.block_hash for block in new]

    def trim(self, request_id: str, keep: int) -> None:
        """The request keeps its first ``keep`` blocks; the private ones after are free."""
        holding = self._holdings[request_id]
        if not len(holding.cached) <= keep <= holding.num_blocks:
            raise LedgerError(f"{request_id!r} cannot keep {keep} of its {holding.num_blocks} blocks")
        self.num_free += holding.num_blocks - keep
        holding.num_blocks = keep

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
        """Evict every cached block no request holds (a prefix-cache reset), and drop every block of
        the host tier, which the reset empties too; how many GPU blocks."""
        if self.cache is None:
            return 0
        evicted = self.cache.evict(self.cache.num_evictable)
        self._evicted.extend(block.block_hash for block in evicted)
        self.num_free += len(evicted)
        if self.host is not None:  # nothing goes there, and what was there goes (backups of idle blocks too)
            for block in evicted:
                self.host.backups.pop(block.block_hash, None)
                self.host.arrived.pop(block.block_hash, None)
                self._backups.pop(block.block_hash, None)
                self._host_dropped[block.block_hash] = None
            for value in list(self.host.blocks):
                self.host.discard(value)
                self._host_dropped[value] = None
        return len(evicted)

    @property
    def has_evicted(self) -> bool:
        """Evictions the next plan must carry."""
        return bool(self._evicted)

    def take_evicted(self) -> list[int]:
        """Hashes evicted since the last call, in eviction order (for the next plan)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_host_moves(self, step_id: int = 0) -> tuple[list[int], list[int]]:
        """The host tier's decisions since the last call (for the next plan, of ``step_id``, which
        ends the pass): the hashes dropped from it and those taken back to the GPU pool, parents
        first. (``take_backups``: those copied there.)"""
        dropped, self._host_dropped = list(self._host_dropped), {}
        restored, self._restored = list(self._restored), {}
        if self.host is not None:
            self.host.end_pass()
            self.host.stamp(self._arrivals, step_id)
            self._arrivals = []
        return dropped, restored

    def take_backups(self) -> list[int]:
        """Hashes of the blocks backed up since the last call, in caching order (for the next plan)."""
        backups, self._backups = list(self._backups), {}
        return backups

    def step_done(self, step_id: int) -> None:
        """The result of a plan that ran a step is back (its copies and older ones' are done, as
        ``protocol.write_through`` says)."""
        self._launched.append(step_id)

    def resume_host(self, old: BlockLedger) -> None:
        """A worker was restarted (this ledger replaces ``old``): the host tier outlived it. Its
        blocks stay, with the GPU's backed-up blocks now held there alone, less the copies not known
        complete (plans without ``LAG`` later results back), which the next plan drops."""
        if self.host is None or old.host is None or old.host.capacity != self.host.capacity:
            return
        launched = old._launched
        trusted_below = launched[0] if len(launched) == LAG else old._first_step_id
        self._host_dropped.update(old._host_dropped)
        doubtful = old.host.resume(trusted_below)
        self.host = old.host
        self._host_dropped.update(dict.fromkeys(doubtful))
        self.host_resumed = True

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
        if self.host is not None:
            self.host.check_invariants()
            gpu = self.cache.cached_hashes()
            both = gpu & set(self.host.blocks)
            if both:
                raise AssertionError(f"blocks cached both on the GPU and in the host tier: {sorted(both)[:8]}")
            if not set(self.host.backups) <= gpu:
                raise AssertionError(f"backups of blocks not cached: {sorted(set(self.host.backups) - gpu)[:8]}")
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
