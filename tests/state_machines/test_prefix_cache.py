"""The prefix cache: taking hits, caching blocks as they fill, reference counts, LRU eviction,
duplicates, hashes, and a random walk of a whole KV pool checked against a simple reference model
after every step. Only the calls the scheduler's ledger makes: ``take``, ``match_length``,
``extend``, ``release``, ``evict``."""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from vllm_actors.actors.scheduler.prefix_cache import CachedBlock, PrefixCache
from vllm_actors.protocol.block_hash import ROOT_HASH, block_hash, root_hash

BS = 4


def toks(*blocks: str) -> list[int]:
    """Tokens from block spellings: toks("abcd", "efgh") -> 8 ids, one per letter."""
    return [ord(c) for block in blocks for c in block]


def ids(blocks: Sequence[CachedBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def cache_tokens(cache: PrefixCache, tokens: list[int], table: list[int]) -> list[int]:
    """A request computing ``tokens`` in blocks ``table``: takes its hit, caches the rest of its
    full blocks. Returns its cached front (which it holds)."""
    hit = cache.take(tokens)
    new = cache.extend(hit[-1] if hit else None, tokens[len(hit) * BS :], table[len(hit) :])
    return hit + ids(new)


def cache_with(*sequences: tuple[list[int], list[int]]) -> PrefixCache:
    """A cache holding these (tokens, block ids) sequences, none of them referenced any more."""
    cache = PrefixCache(BS)
    for tokens, block_ids in sequences:
        cache.release(cache_tokens(cache, tokens, block_ids))
    cache.check_invariants()
    return cache


def touch(cache: PrefixCache, tokens: list[int]) -> None:
    """A request takes the hit of ``tokens`` and ends at once: the path counts as used."""
    cache.release(cache.take(tokens))


# -- hashes -------------------------------------------------------------------------------------


def test_block_hash_is_blake2b_64_of_parent_hash_and_tokens() -> None:
    data = (0).to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in (1, 2, 3, 4))
    expected = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    assert block_hash(ROOT_HASH, [1, 2, 3, 4]) == expected
    assert block_hash(expected, [5]) == int.from_bytes(
        hashlib.blake2b(struct.pack("<QI", expected, 5), digest_size=8).digest(), "little"
    )
    with pytest.raises(ValueError):
        block_hash(ROOT_HASH, [-1])


def test_hashes_chain_through_parents_and_do_not_depend_on_block_ids() -> None:
    cache = PrefixCache(BS)
    first = cache.extend(None, toks("aaaa", "bbbb"), [0, 1])
    second = cache.extend(None, toks("cccc", "bbbb"), [2, 3])
    assert [b.parent_hash for b in first] == [ROOT_HASH, first[0].block_hash]
    assert first[0].block_hash == block_hash(ROOT_HASH, toks("aaaa"))
    assert first[1].block_hash == block_hash(first[0].block_hash, toks("bbbb"))
    assert cache.block_hash_of(1) == first[1].block_hash
    # the same content under different parents hashes differently
    assert first[1].block_hash != second[1].block_hash
    cache.release([0, 1])
    cache.release([2, 3])
    assert len(cache.evict(4)) == 4
    again = cache.extend(None, toks("aaaa", "bbbb"), [7, 5])
    assert [(b.block_hash, b.parent_hash) for b in again] == [(b.block_hash, b.parent_hash) for b in first]
    cache.check_invariants()


def test_each_lora_adapter_caches_under_its_own_root() -> None:
    """The same tokens under adapters 1 and 2 and the base model: three chains, hashed apart from
    their roots (``root_hash``: blake2b personalised ``lora`` over the id), never matched across;
    releasing and evicting works on any root."""
    cache = PrefixCache(BS)
    base = cache.extend(None, toks("aaaa", "bbbb"), [0, 1])
    one = cache.extend(None, toks("aaaa", "bbbb"), [2, 3], lora_int_id=1)
    two = cache.extend(None, toks("aaaa"), [4], lora_int_id=2)
    digest = hashlib.blake2b(struct.pack("<Q", 1), digest_size=8, person=b"lora").digest()
    assert root_hash(0) == ROOT_HASH and root_hash(1) == int.from_bytes(digest, "little")
    assert one[0].parent_hash == root_hash(1) and two[0].parent_hash == root_hash(2)
    assert len({base[0].block_hash, one[0].block_hash, two[0].block_hash}) == 3
    assert cache.match_length(toks("aaaa", "bbbb", "c")) == 2
    assert cache.match_length(toks("aaaa", "bbbb", "c"), lora_int_id=1) == 2
    assert cache.match_length(toks("aaaa", "bbbb", "c"), lora_int_id=2) == 1
    assert cache.match_length(toks("aaaa", "bbbb", "c"), lora_int_id=3) == 0
    assert cache.take(toks("aaaa", "bbbb", "c"), lora_int_id=1) == [2, 3]
    for blocks in ([0, 1], [2, 3], [2, 3], [4]):
        cache.release(blocks)
    cache.check_invariants()
    assert sorted(block.block_id for block in cache.evict(5)) == [0, 1, 2, 3, 4]
    cache.check_invariants()


# -- matching -----------------------------------------------------------------------------------


def test_take_and_match_length_full_partial_and_none() -> None:
    cache = cache_with((toks("abcd", "efgh", "ijkl"), [10, 11, 12]))
    assert cache.match_length(toks("abcd", "efgh", "ijkl")) == 3
    assert cache.match_length(toks("abcd", "efgh", "ijkl", "mnop")) == 3
    assert cache.match_length(toks("abcd", "efgh", "xxxx")) == 2
    assert cache.match_length(toks("abcd", "efgX")) == 1
    assert cache.match_length(toks("Xbcd", "efgh")) == 0
    assert cache.match_length([]) == 0
    assert PrefixCache(BS).match_length(toks("abcd")) == 0
    assert cache.num_evictable == 3  # match_length takes nothing
    assert cache.take(toks("abcd", "efgh", "xxxx")) == [10, 11]
    assert [cache.ref_count(i) for i in (10, 11, 12)] == [1, 1, 0]
    assert cache.take(toks("Xbcd")) == []
    cache.check_invariants()


def test_the_partial_last_block_is_never_matched_nor_cached() -> None:
    cache = PrefixCache(BS)
    assert ids(cache.extend(None, toks("abcd", "ef"), [0, 1])) == [0]  # block 1 is partial
    assert not cache.is_cached(1)
    assert cache.match_length(toks("abcd", "ef")) == 1
    assert cache.match_length(toks("abcd", "efg")) == 1
    assert cache.match_length(toks("abc")) == 0


def test_max_blocks_caps_the_match() -> None:
    prompt = toks("abcd", "efgh", "ijkl")
    cache = cache_with((prompt, [0, 1, 2]))
    assert cache.match_length(prompt, max_blocks=None) == 3
    assert cache.match_length(prompt, max_blocks=5) == 3
    assert cache.match_length(prompt, max_blocks=2) == 2
    assert cache.match_length(prompt, max_blocks=0) == 0
    assert cache.match_length(prompt, max_blocks=-1) == 0
    assert cache.take(prompt, max_blocks=-1) == []
    # the admission cap: a prompt of exactly three blocks still computes its last block
    assert cache.take(prompt, max_blocks=(len(prompt) - 1) // BS) == [0, 1]
    assert cache.take(prompt + [1], max_blocks=len(prompt) // BS) == [0, 1, 2]


def test_shared_prefixes_branch() -> None:
    cache = PrefixCache(BS)
    a = toks("abcd", "efgh", "ijkl")
    b = toks("abcd", "efgh", "wxyz", "1234")
    assert ids(cache.extend(None, a, [0, 1, 2])) == [0, 1, 2]
    hit = cache.take(b)
    assert hit == [0, 1]
    new = cache.extend(1, b[2 * BS :], [5, 6])
    assert ids(new) == [5, 6]
    assert new[0].parent_hash == cache.block_hash_of(1)
    assert cache.num_cached == 5
    assert [cache.ref_count(i) for i in (0, 1, 2, 5, 6)] == [2, 2, 1, 1, 1]
    assert cache.match_length(a) == 3
    assert cache.match_length(b) == 4
    cache.check_invariants()


def test_extend_is_incremental() -> None:
    cache = PrefixCache(BS)
    tokens = toks("abcd", "efgh", "ijkl", "mn")
    table = [3, 4, 5, 6]
    assert ids(cache.extend(None, tokens[:5], table)) == [3]
    assert ids(cache.extend(3, tokens[4:12], table[1:])) == [4, 5]
    assert cache.extend(5, tokens[12:], table[3:]) == []  # the partial last block
    assert [cache.ref_count(i) for i in (3, 4, 5)] == [1, 1, 1]
    cache.release([3, 4, 5])
    assert cache.num_evictable == 3
    cache.check_invariants()


# -- reference counts ---------------------------------------------------------------------------


def test_reference_counts_and_referenced_blocks_are_never_evicted() -> None:
    cache = PrefixCache(BS)
    cache.extend(None, toks("abcd", "efgh"), [0, 1])  # request A computed them: it holds them, ref 1
    assert (cache.ref_count(0), cache.ref_count(1), cache.num_evictable) == (1, 1, 0)
    assert cache.take(toks("abcd", "efgh", "z")) == [0, 1]  # request B shares both
    assert (cache.ref_count(0), cache.ref_count(1)) == (2, 2)
    cache.release([0, 1])  # A ends
    assert (cache.ref_count(0), cache.ref_count(1), cache.num_evictable) == (1, 1, 0)
    assert cache.evict(10) == []
    assert cache.num_cached == 2
    cache.release([0, 1])  # B ends
    assert cache.num_evictable == 2
    assert ids(cache.evict(10)) == [1, 0]
    assert cache.num_cached == 0
    assert not cache.is_cached(0)
    with pytest.raises(KeyError):
        cache.ref_count(0)
    cache.check_invariants()


def test_check_invariants_catches_a_caller_releasing_a_held_path_short() -> None:
    cache = PrefixCache(BS)
    cache.extend(None, toks("abcd", "efgh"), [0, 1])
    cache.release([0])  # the request holds [0, 1]: 1 is now held more than its parent
    with pytest.raises(AssertionError, match="children"):
        cache.check_invariants()


def test_release_takes_a_path_from_the_root_and_checks_before_changing() -> None:
    cache = cache_with((toks("abcd", "efgh", "ijkl"), [0, 1, 2]))
    with pytest.raises(ValueError, match="path"):
        cache.release([1, 2])
    with pytest.raises(ValueError, match="path"):
        cache.release([0, 2])
    with pytest.raises(ValueError, match="not cached"):
        cache.release([0, 9])
    assert cache.take(toks("abcd")) == [0]
    with pytest.raises(ValueError, match="not referenced"):
        cache.release([0, 1])
    assert (cache.ref_count(0), cache.ref_count(1)) == (1, 0)  # the failed release changed nothing
    cache.release([0])
    assert cache.num_evictable == 3
    cache.check_invariants()


def test_extend_rejects_bad_block_ids_and_parents() -> None:
    cache = PrefixCache(BS)
    with pytest.raises(ValueError, match="full blocks"):
        cache.extend(None, toks("abcd", "efgh"), [0])
    cache.extend(None, toks("abcd"), [0])
    with pytest.raises(ValueError, match="already cached elsewhere"):
        cache.extend(None, toks("wxyz", "efgh"), [5, 0])
    with pytest.raises(ValueError, match="repeated"):
        cache.extend(None, toks("wxyz", "efgh"), [5, 5])
    with pytest.raises(ValueError, match="not cached"):
        cache.extend(9, toks("efgh"), [1])
    cache.release([0])
    with pytest.raises(ValueError, match="not held"):
        cache.extend(0, toks("efgh"), [1])  # block 0 was not taken again
    assert cache.num_cached == 1
    cache.check_invariants()


# -- duplicates ---------------------------------------------------------------------------------


def test_a_duplicate_keeps_the_cached_block_and_caches_nothing() -> None:
    cache = PrefixCache(BS)
    prompt = toks("abcd", "efgh", "ijkl")
    # A and B both missed and computed the same prefix concurrently; A caches first.
    assert ids(cache.extend(None, prompt, [0, 1, 2])) == [0, 1, 2]
    assert cache.extend(None, prompt + toks("mnop"), [5, 6, 7, 8]) == []
    assert not any(cache.is_cached(i) for i in (5, 6, 7, 8))  # B frees them itself at the end
    assert cache.num_cached == 3 and cache.ref_count(0) == 1
    # the admission cap makes a repeated exact-block prompt recompute its last block: that block is
    # a duplicate, and B's cached front stays the blocks it took
    hit = cache.take(prompt, max_blocks=(len(prompt) - 1) // BS)
    assert hit == [0, 1]
    assert cache.extend(1, toks("ijkl", "qrst"), [9, 10]) == []
    assert not cache.is_cached(9)
    # once A's copy is gone, B's later extend caches its own blocks from there
    cache.release([0, 1, 2])
    assert ids(cache.evict(1)) == [2]
    assert ids(cache.extend(1, toks("ijkl", "qrst"), [9, 10])) == [9, 10]
    cache.check_invariants()


# -- eviction -----------------------------------------------------------------------------------


def test_lru_eviction_takes_leaves_first_least_recently_used_first() -> None:
    cache = cache_with(
        (toks("aaaa", "bbbb", "cccc"), [0, 1, 2]),
        (toks("aaaa", "bbbb", "dddd"), [0, 1, 3]),
        (toks("eeee", "ffff"), [4, 5]),
    )
    assert cache.num_evictable == 6
    touch(cache, toks("aaaa", "bbbb", "cccc"))  # touches 0, 1, 2
    # LRU leaf is 3 (its path was stamped before 5's); then 5, then 4 (a leaf now, older than 2)
    assert ids(cache.evict(3)) == [3, 5, 4]
    assert ids(cache.evict(1)) == [2]
    assert ids(cache.evict(5)) == [1, 0]  # never a parent before its child
    assert cache.num_cached == 0 and cache.num_evictable == 0
    assert cache.evict(1) == []
    cache.check_invariants()


def test_using_part_of_a_path_protects_that_part_only() -> None:
    cache = cache_with((toks("aaaa", "bbbb", "cccc"), [0, 1, 2]), (toks("xxxx"), [9]))
    touch(cache, toks("aaaa", "bbbb"))  # the leaf 2 keeps its old stamp
    assert ids(cache.evict(2)) == [2, 9]  # 2 is older than 9; 1 is now a leaf but newer than 9
    assert ids(cache.evict(2)) == [1, 0]
    cache.check_invariants()


def test_match_length_does_not_count_as_a_use() -> None:
    cache = cache_with((toks("aaaa"), [0]), (toks("bbbb"), [1]))
    assert cache.match_length(toks("aaaa")) == 1
    assert ids(cache.evict(1)) == [0]
    cache.check_invariants()


def test_released_blocks_count_as_recently_used() -> None:
    cache = PrefixCache(BS)
    cache.extend(None, toks("aaaa"), [0])  # request A, long running
    cache.extend(None, toks("bbbb"), [1])
    cache.release([1])
    cache.release([0])  # A finishes after B: its block is the more recently used
    assert ids(cache.evict(1)) == [1]
    cache.check_invariants()


def test_the_eviction_queue_stays_bounded() -> None:
    cache = cache_with((toks("aaaa", "bbbb"), [0, 1]), (toks("cccc"), [2]))
    for _ in range(2000):
        touch(cache, toks("aaaa", "bbbb"))
    assert len(cache._heap) <= 2 * cache.num_cached + 65
    assert ids(cache.evict(3)) == [2, 1, 0]
    cache.check_invariants()


# -- a whole KV pool, random operations, checked against a reference model ----------------------

MODEL_BS = 2
NUM_BLOCKS = 10
Prefix = tuple[tuple[int, ...], ...]  # the block-aligned token prefix of a cached block


@dataclass
class ModelBlock:
    block_id: int
    ref: int
    stamp: int


@dataclass
class Request:
    tokens: list[int]
    table: list[int]
    num_cached: int  # the front of the table that the cache owns
    computed: int  # tokens whose KV is written


@dataclass
class Model:
    """The cache as a dict from block-aligned prefixes to blocks, every query a scan."""

    blocks: dict[Prefix, ModelBlock] = field(default_factory=dict)
    clock: int = 0

    @staticmethod
    def prefix(tokens: Sequence[int], num_blocks: int) -> Prefix:
        return tuple(tuple(tokens[i * MODEL_BS:(i + 1) * MODEL_BS]) for i in range(num_blocks))

    def stamp(self, prefixes: list[Prefix]) -> None:
        if prefixes:
            self.clock += 1
            for p in prefixes:
                self.blocks[p].stamp = self.clock

    def match(self, tokens: Sequence[int], limit: int, stamp: bool = True) -> list[Prefix]:
        limit = min(limit, len(tokens) // MODEL_BS)
        path = []
        for n in range(1, limit + 1):
            if self.prefix(tokens, n) not in self.blocks:
                break
            path.append(self.prefix(tokens, n))
        if stamp:
            self.stamp(path)
        return path

    def cached_block(self, p: Prefix) -> CachedBlock:
        parent_hash = ROOT_HASH
        for n in range(1, len(p)):
            parent_hash = block_hash(parent_hash, p[n - 1])
        return CachedBlock(self.blocks[p].block_id, block_hash(parent_hash, p[-1]), parent_hash)

    def add_refs(self, path: list[Prefix], delta: int) -> None:
        for p in path:
            self.blocks[p].ref += delta
        self.stamp(path)

    def insert(self, tokens: Sequence[int], table: Sequence[int]) -> list[Prefix]:
        path, new = [], []
        for n in range(1, len(tokens) // MODEL_BS + 1):
            p = self.prefix(tokens, n)
            if p not in self.blocks:
                self.blocks[p] = ModelBlock(table[n - 1], 1, 0)
                new.append(p)
            elif self.blocks[p].block_id != table[n - 1]:
                break
            path.append(p)
        self.stamp(path)
        return new

    def evict(self, count: int) -> list[CachedBlock]:
        out = []
        for _ in range(count):
            parents = {p[:-1] for p in self.blocks}
            leaves = [p for p, b in self.blocks.items() if b.ref == 0 and p not in parents]
            if not leaves:
                break
            stamps = sorted(self.blocks[p].stamp for p in leaves)
            assert len(stamps) == 1 or stamps[0] < stamps[1], "two evictable leaves share a stamp"
            victim = min(leaves, key=lambda p: self.blocks[p].stamp)
            out.append(self.cached_block(victim))
            del self.blocks[victim]
        return out


def note(text: str) -> None:
    """Count an interesting case for ``--hypothesis-show-statistics`` (outside hypothesis: nothing)."""
    if currently_in_test_context():
        event(text)


tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=9)


class PoolMachine(RuleBasedStateMachine):
    """A KV manager in miniature: a free list, live requests with block tables, and the cache."""

    def __init__(self) -> None:
        super().__init__()
        self.cache = PrefixCache(MODEL_BS)
        self.model = Model()
        self.free = list(range(NUM_BLOCKS))
        self.requests: list[Request] = []
        self.seen: list[list[int]] = []  # every request's tokens, live or finished: cached content
        self.calls = 0  # alternates admission with and without a look-up first

    # helpers

    def take(self, count: int) -> list[int] | None:
        """``count`` blocks from the free list, evicting cached ones if short; None if impossible."""
        if count > len(self.free) + self.cache.num_evictable:
            return None
        if count > len(self.free):
            evicted = self.cache.evict(count - len(self.free))
            assert evicted == self.model.evict(count - len(self.free))
            self.free.extend(ids(evicted))
            note("evicted to allocate")
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def path_of(self, request: Request) -> list[Prefix]:
        return [Model.prefix(request.tokens, n) for n in range(1, request.num_cached + 1)]

    def admit(self, tokens: list[int]) -> None:
        limit = (len(tokens) - 1) // MODEL_BS
        expected = self.model.match(tokens, limit)
        hit = [self.model.cached_block(p) for p in expected]
        self.calls += 1
        if self.calls % 2:  # the waiting queue's ordering looks first, then admission takes
            assert self.cache.match_length(tokens, max_blocks=limit) == len(hit)
            if any(self.cache.ref_count(b.block_id) == 0 for b in hit):
                note("admission hit evictable blocks")
        assert self.cache.take(tokens, max_blocks=limit) == ids(hit)
        self.model.add_refs(expected, +1)
        note(f"admission hit {min(len(hit), 2)}+ blocks")
        blocks = self.take(-(-len(tokens) // MODEL_BS) - len(hit))
        if blocks is None:  # no room after all: give the hit back
            self.cache.release(ids(hit))
            self.model.add_refs(expected, -1)
            note("admission refused")
            return
        self.requests.append(Request(tokens, ids(hit) + blocks, len(hit), len(hit) * MODEL_BS))
        self.seen.append(tokens)  # the same list: it grows as the request decodes

    # rules

    @rule(tokens=tokens_st)
    def start(self, tokens: list[int]) -> None:
        self.admit(tokens)

    def related(self, index: int, keep: int, extra: list[int]) -> list[int]:
        """A prefix of an earlier request's tokens (maybe all of them), then ``extra``."""
        return self.seen[index % len(self.seen)][:keep] + extra

    @precondition(lambda self: self.seen)
    @rule(index=st.integers(0, 99), keep=st.integers(0, 8), extra=st.lists(st.integers(0, 2), max_size=3))
    def start_related(self, index: int, keep: int, extra: list[int]) -> None:
        """A prompt sharing (or repeating) an earlier prompt's prefix: provokes hits, on held and
        on evictable blocks, and duplicates."""
        tokens = self.related(index, keep, extra)
        if tokens:
            self.admit(tokens)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 99), amount=st.integers(1, 6))
    def compute(self, index: int, amount: int) -> None:
        """A step writes some more KV; the request's full blocks are offered to the cache."""
        request = self.requests[index % len(self.requests)]
        request.computed = min(len(request.tokens), request.computed + amount)
        front = request.num_cached
        parent = request.table[front - 1] if front else None
        new = self.cache.extend(parent, request.tokens[front * MODEL_BS : request.computed], request.table[front:])
        expected = self.model.insert(request.tokens[: request.computed], request.table)
        assert new == [self.model.cached_block(p) for p in expected]
        request.num_cached += len(new)
        if request.num_cached < request.computed // MODEL_BS:
            note("full blocks left private by a duplicate")

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 99), generated=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def decode(self, index: int, generated: list[int]) -> None:
        request = self.requests[index % len(self.requests)]
        if request.computed < len(request.tokens):
            return
        needed = -(-(len(request.tokens) + len(generated)) // MODEL_BS) - len(request.table)
        blocks = self.take(max(needed, 0))
        if blocks is not None:
            request.tokens.extend(generated)
            request.table.extend(blocks)

    @precondition(lambda self: self.requests)
    @rule(index=st.integers(0, 99))
    def finish(self, index: int) -> None:
        request = self.requests.pop(index % len(self.requests))
        self.cache.release(request.table[: request.num_cached])
        self.model.add_refs(self.path_of(request), -1)
        self.free.extend(request.table[request.num_cached:])

    @precondition(lambda self: self.seen)
    @rule(index=st.integers(0, 99), keep=st.integers(1, 10))
    def peek(self, index: int, keep: int) -> None:
        """A lookup taking nothing (ordering the waiting queue): not a use either."""
        tokens = self.related(index, keep, [])
        assert self.cache.match_length(tokens) == len(self.model.match(tokens, len(tokens), stamp=False))

    @rule(count=st.sampled_from([0, 0, 1, 3]))
    def evict(self, count: int) -> None:
        evicted = self.cache.evict(count)
        assert evicted == self.model.evict(count)
        self.free.extend(ids(evicted))
        note(f"evict rule freed {min(len(evicted), 2)}+")

    # checks

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        model_ids = {b.block_id: b for b in self.model.blocks.values()}
        assert self.cache.cached_block_ids() == set(model_ids)
        holders = {block_id: 0 for block_id in model_ids}
        for request in self.requests:
            for n, p in enumerate(self.path_of(request)):
                assert self.model.blocks[p].block_id == request.table[n]
                holders[request.table[n]] += 1
        for block_id, block in model_ids.items():
            assert self.cache.ref_count(block_id) == block.ref == holders[block_id]
        assert self.cache.num_evictable == sum(b.ref == 0 for b in model_ids.values())
        # the pool: free + cached + private == total, all disjoint
        private = [b for r in self.requests for b in r.table[r.num_cached:]]
        everything = self.free + list(model_ids) + private
        assert sorted(everything) == list(range(NUM_BLOCKS))

    def teardown(self) -> None:
        """Every request ends and every cached block can be evicted back to the pool."""
        while self.requests:
            self.finish(0)
        self.evict(NUM_BLOCKS)
        assert self.cache.num_cached == 0 and sorted(self.free) == list(range(NUM_BLOCKS))
        self.cache.check_invariants()


PoolMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPrefixCacheAgainstModel = PoolMachine.TestCase


@pytest.mark.parametrize("seed", range(3))
def test_long_random_walks_against_the_model(seed: int) -> None:
    """Many more steps than the hypothesis runs (deep trees, heap compaction), seeded: a failure
    names its seed and step at once; the hypothesis test above is the one that shrinks."""
    rng = random.Random(seed)

    def some_tokens(low: int, high: int) -> list[int]:
        return [rng.randint(0, 2) for _ in range(rng.randint(low, high))]

    machine = PoolMachine()
    steps = [
        lambda: machine.start(some_tokens(1, 9)),
        lambda: machine.seen and machine.start_related(rng.randrange(99), rng.randint(0, 8), some_tokens(0, 3)),
        lambda: machine.requests and machine.compute(rng.randrange(99), rng.randint(1, 6)),
        lambda: machine.requests and machine.decode(rng.randrange(99), some_tokens(1, 3)),
        lambda: machine.requests and machine.finish(rng.randrange(99)),
        lambda: machine.seen and machine.peek(rng.randrange(99), rng.randint(1, 10)),
        lambda: machine.evict(rng.choice([0, 0, 1, 3])),
    ]
    for _ in range(3000):
        rng.choice(steps)()
        machine.consistent()
    machine.teardown()
