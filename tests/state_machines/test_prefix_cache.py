"""The prefix cache: taking hits, caching blocks as they fill, reference counts, LRU eviction,
duplicates and hashes, one call at a time (a whole pool under random operations, against a
reference model: test_prefix_cache_model.py). Only the calls the scheduler's ledger makes:
``take``, ``match_length``, ``extend``, ``release``, ``evict``."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import pytest

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

