"""The prefix cache against a reference model: a KV pool in miniature (a free list, live requests
with block tables, the cache) under random operations, checked after every step against a plain
dict of block-aligned prefixes; by hypothesis (which shrinks a failure) and by long seeded walks.
Only the calls the scheduler's ledger makes: ``take``, ``match_length``, ``extend``, ``release``,
``evict``."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.state_machines.test_prefix_cache import ids
from vllm_actors.actors.scheduler.prefix_cache import CachedBlock, PrefixCache
from vllm_actors.protocol.block_hash import ROOT_HASH, block_hash

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
