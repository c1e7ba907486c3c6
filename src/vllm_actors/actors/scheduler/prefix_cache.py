"""Prefix caching: a tree over FULL KV blocks of token ids, so requests sharing a prompt prefix
reuse the KV blocks already computed (SGLang's radix tree idea, at block granularity).

Shape. Each node is one full block (``block_size`` token ids), keyed by its token tuple under its
parent: a trie of blocks. Runs of blocks are deliberately not compressed into one node: reference
counts, LRU stamps, eviction and the BLOCK_CACHED / BLOCK_EVICTED events are all per block, so one
node per block keeps every operation a plain walk with no node splitting. Matching costs one dict
lookup per block. Each node carries a stable block hash, ``block_hash(parent_hash, token_ids)``
(``vllm_actors.protocol.block_hash``), the root's being ``ROOT_HASH``, so a router outside the
engine can mirror the tree from the events alone. Keys are the token tuples themselves, so a hash
collision can never make two different prefixes share a block here. Requests of a LoRA adapter
(``lora_int_id``) grow their own tree under a root of their own (``root_hash``): two adapters, or
an adapter and the base model, never share a block.

Block ids here are labels (the scheduler's ``BlockLedger`` hands them out): the KV-cache manager
owns the real blocks and learns the decisions by block hash. A block is, as far as the ledger is
concerned: free; private to one request (the partial last block, or a block whose content another
request had cached first, see ``extend``); cached and referenced (``ref_count > 0``: held by that
many live requests, shared when > 1); or cached and unreferenced (``ref_count == 0``: its KV still
valid, evictable). ``num_evictable`` counts the last state.

Reference counts follow one rule: a request holds exactly the cached blocks at the front of its
block table, a path from the root; every referenced block's ancestors are referenced at least as
much, so every unreferenced block can actually be evicted (leaves first).

How the ledger uses it, for a request with tokens ``T``:

1. Admission: ``hit = cache.take(T, max_blocks=(len(T) - 1) // block_size)`` (the cap leaves at
   least one token to compute, for the logits) takes the longest cached prefix and a reference to
   each of its blocks, before any eviction in the same pass could take them. If admission fails
   after all, ``cache.release(hit)``. ``match_length`` looks the same up without taking or
   stamping anything (to order the waiting queue).
2. As the request's KV is written: ``cache.extend(front_block, tokens_after_front, labels)``
   caches its next full blocks (each starting with the request's reference) and returns them;
   the request's cached front grows by that many.
3. Finish, abort or preemption: ``cache.release(cached_front)``.
4. Running short of free blocks: ``cache.evict(n)`` frees idle blocks, before anyone is preempted.

A shared block is never written again: a request only writes from its first uncomputed token,
which lies past its matched (full) blocks.

LRU uses a logical clock, no wall clock: every call that takes a path (``take``, ``release``)
advances it and stamps that path; ``extend`` stamps the blocks it adds (the path above them is
held, so unevictable, until its ``release`` stamps it). Since one call stamps one root path, two cached
leaves never share a stamp, so the eviction order is fully determined.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from vllm_actors.protocol.block_hash import ROOT_HASH, block_hash, root_hash


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """A cached block as reported to the caller (and in BLOCK_CACHED / BLOCK_EVICTED events)."""

    block_id: int
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...] = field(default=(), compare=False)  # its content (for the host tier)


class _Node:
    __slots__ = ("key", "block_id", "block_hash", "parent", "children", "ref_count", "last_used", "serial", "alive")

    def __init__(self, key: tuple[int, ...], block_id: int, parent: _Node | None, serial: int) -> None:
        self.key = key
        self.block_id = block_id
        self.block_hash: int = ROOT_HASH if parent is None else block_hash(parent.block_hash, key)
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.ref_count = 0
        self.last_used = 0
        self.serial = serial  # creation order: breaks heap ties without comparing nodes
        self.alive = True

    @property
    def evictable_leaf(self) -> bool:
        return self.alive and self.ref_count == 0 and not self.children

    def to_cached(self) -> CachedBlock:
        assert self.parent is not None, "the root is not a block"
        return CachedBlock(block_id=self.block_id, block_hash=self.block_hash, parent_hash=self.parent.block_hash,
                           token_ids=self.key)


class PrefixCache:
    """A tree of cached full blocks with reference counts and LRU eviction. Pure: no I/O, no clock."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._root = _Node(key=(), block_id=-1, parent=None, serial=0)
        self._roots: dict[int, _Node] = {0: self._root}  # by LoRA adapter id (0: the base model)
        self._nodes: dict[int, _Node] = {}  # block id -> node, every cached block
        self._num_evictable = 0  # cached blocks with ref_count 0
        self._clock = 0
        self._serial = 0
        # Candidates for eviction: (last_used, serial, node), pushed whenever a node becomes an
        # evictable leaf or is restamped as one. Stale entries are skipped when popped.
        self._heap: list[tuple[int, int, _Node]] = []
        self._last_match: tuple[array[int], list[_Node]] = (array("i"), [])  # see _match_path

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_cached(self) -> int:
        return len(self._nodes)

    @property
    def num_evictable(self) -> int:
        """Cached blocks no live request holds; ``evict`` can free all of them."""
        return self._num_evictable

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._nodes

    def ref_count(self, block_id: int) -> int:
        """Live requests holding this cached block; KeyError if it is not cached."""
        return self._nodes[block_id].ref_count

    def cached_hashes(self) -> set[int]:
        """The hashes of every cached block (a walk: for checks)."""
        return {node.block_hash for node in self._walk_all()}

    def cached_block_ids(self) -> set[int]:
        return set(self._nodes)

    # -- operations ------------------------------------------------------------------------------

    def root(self, lora_int_id: int = 0) -> _Node:
        """The root of an adapter's tree (made on first use; never removed)."""
        node = self._roots.get(lora_int_id)
        if node is None:
            node = self._roots[lora_int_id] = _Node(key=(), block_id=-1, parent=None, serial=0)
            node.block_hash = root_hash(lora_int_id)
        return node

    def match_length(self, token_ids: Sequence[int], max_blocks: int | None = None, lora_int_id: int = 0) -> int:
        """How many blocks ``take`` would take (at most ``max_blocks``, below 0 counting as 0),
        without taking or stamping anything (for ordering)."""
        return len(self._match_path(token_ids, max_blocks, self.root(lora_int_id)))

    def take(self, token_ids: Sequence[int], max_blocks: int | None = None, lora_int_id: int = 0) -> list[int]:
        """The ids of the longest cached prefix of ``token_ids`` made of full blocks (at most
        ``max_blocks`` blocks, below 0 counting as 0) in the tree of adapter ``lora_int_id``, each
        now holding one more reference and stamped as used."""
        path = self._match_path(token_ids, max_blocks, self.root(lora_int_id))
        self._hold(path)
        return [node.block_id for node in path]

    def block_hash_of(self, block_id: int) -> int:
        """The hash of a cached block; KeyError if it is not cached."""
        return self._nodes[block_id].block_hash

    def release(self, blocks: Sequence[int]) -> None:
        """A request stops using these cached blocks, a path from the root (the cached front of
        its block table): each loses one reference, and unreferenced ones become evictable."""
        path = self._path(blocks)
        for node in path:
            if node.ref_count == 0:
                raise ValueError(f"block {node.block_id} released while not referenced")
        for node in path:
            node.ref_count -= 1
            if node.ref_count == 0:
                self._num_evictable += 1
        self._stamp(path)

    def extend(self, parent_block: int | None, token_ids: Sequence[int], block_ids: Sequence[int],
               lora_int_id: int = 0) -> list[CachedBlock]:
        """Cache a request's next full blocks: its cached front ends at ``parent_block`` (None:
        the root of adapter ``lora_int_id``'s tree), ``token_ids`` are the tokens right after that
        front and ``block_ids[i]`` holds ``token_ids[i*bs:(i+1)*bs]`` (extra ids, such as a partial
        last block, are ignored). Walks only the new part, so a request caches its blocks as they
        fill at a cost independent of its length. The parent must be held by the caller. If the first block's content is
        already cached under another id (two requests computed the same prefix concurrently),
        the cached one is kept and nothing is cached: the caller's blocks stay private. Returns
        the blocks newly cached, in order; each starts with one reference, the caller's."""
        if parent_block is None:
            parent = self.root(lora_int_id)
        else:
            found = self._nodes.get(parent_block)
            if found is None:
                raise ValueError(f"block {parent_block} is not cached")
            parent = found
            if parent.ref_count == 0:
                raise ValueError(f"block {parent_block} is cached but not held")
        num_full = len(token_ids) // self.block_size
        if len(block_ids) < num_full:
            raise ValueError(f"{num_full} full blocks of tokens but only {len(block_ids)} block ids")
        keys = list(self._keys(token_ids, num_full))
        if keys and keys[0] in parent.children:
            return []
        new_nodes = self._add_chain(parent, keys, block_ids[:num_full])
        # Only the new blocks are stamped: the path above them is held by the caller, so it cannot
        # be evicted before ``release``, which stamps the whole path (restamping it here would cost
        # the request's length on every chunk of a long prompt).
        self._stamp(new_nodes)
        return [n.to_cached() for n in new_nodes]

    def evict(self, num_blocks: int) -> list[CachedBlock]:
        """Uncache up to ``num_blocks`` unreferenced blocks, least recently used leaf first (a
        block goes only once no descendant is cached). Returns them in eviction order; their ids
        go back to the caller's free pool."""
        evicted: list[CachedBlock] = []
        while len(evicted) < num_blocks and self._heap:
            stamp, _, node = heapq.heappop(self._heap)
            if not node.evictable_leaf or node.last_used != stamp:
                continue  # stale: restamped, referenced, grown a child or already gone
            parent = node.parent
            assert parent is not None
            evicted.append(node.to_cached())
            del parent.children[node.key]
            del self._nodes[node.block_id]
            node.alive = False
            self._num_evictable -= 1
            self._offer(parent)
        return evicted

    def check_invariants(self) -> None:
        """Raise AssertionError unless the tree, the hashes, the reference counts, the block-id
        index and the evictable count are consistent."""
        seen: set[int] = set()
        evictable = 0
        for node in self._walk_all():
            parent = node.parent
            if parent is None or parent.children.get(node.key) is not node:
                raise AssertionError(f"block {node.block_id} is not its parent's child under its key")
            if len(node.key) != self.block_size:
                raise AssertionError(f"block {node.block_id} holds {len(node.key)} tokens, not {self.block_size}")
            if node.block_hash != block_hash(parent.block_hash, node.key):
                raise AssertionError(f"block {node.block_id} has a wrong hash")
            if not node.alive or self._nodes.get(node.block_id) is not node or node.block_id in seen:
                raise AssertionError(f"block {node.block_id} is missing from or repeated in the index")
            seen.add(node.block_id)
            if node.ref_count < 0:
                raise AssertionError(f"block {node.block_id} has ref count {node.ref_count}")
            held_below = sum(child.ref_count for child in node.children.values())
            if node.ref_count < held_below:
                raise AssertionError(f"block {node.block_id} has ref {node.ref_count} < its children's {held_below}")
            if not 0 < node.last_used <= self._clock:
                raise AssertionError(f"block {node.block_id} has stamp {node.last_used} outside (0, {self._clock}]")
            evictable += node.ref_count == 0
        if len(seen) != len(self._nodes):
            raise AssertionError(f"{len(self._nodes)} blocks indexed but {len(seen)} in the tree")
        if evictable != self._num_evictable:
            raise AssertionError(f"evictable count {self._num_evictable} but {evictable} unreferenced blocks")
        queued = {id(node) for stamp, _, node in self._heap if node.evictable_leaf and node.last_used == stamp}
        for node in self._nodes.values():
            if node.evictable_leaf and id(node) not in queued:
                raise AssertionError(f"evictable leaf {node.block_id} is not queued for eviction")

    # -- internals -------------------------------------------------------------------------------

    def _match_path(self, token_ids: Sequence[int], max_blocks: int | None, root: _Node) -> list[_Node]:
        size = self.block_size
        limit = len(token_ids) // size
        if max_blocks is not None:
            limit = min(limit, max(max_blocks, 0))
        path: list[_Node] = []
        node = root
        # Requests sharing a prompt prefix come in runs: when this one starts with the tokens of
        # the previous match, reuse that path (one comparison of int32 arrays in C instead of a
        # tuple and a lookup per block). An alive node's ancestors are alive: eviction takes leaves only.
        previous_tokens, previous_path = self._last_match
        reuse = min(len(previous_path), limit)
        prefix = reuse * size
        if (reuse and previous_path[reuse - 1].alive and previous_path[0].parent is root
                and _int32s(token_ids[:prefix]) == previous_tokens[:prefix]):
            path = previous_path[:reuse]
            node = path[-1]
        for key in self._keys(token_ids, limit - len(path), first=len(path)):  # no copy of the prompt's rest
            child = node.children.get(key)
            if child is None:
                break
            path.append(child)
            node = child
        self._last_match = (_int32s(token_ids[: len(path) * size]), path)
        return path

    def _add_chain(self, parent: _Node, keys: Sequence[tuple[int, ...]], block_ids: Sequence[int]) -> list[_Node]:
        """New nodes for ``keys`` under ``parent``, one per id, each held once by the caller."""
        new_ids = list(block_ids)
        taken = [block_id for block_id in new_ids if block_id in self._nodes]
        if taken or len(set(new_ids)) != len(new_ids):
            raise ValueError(f"block ids already cached elsewhere or repeated: {taken or new_ids}")
        new_nodes: list[_Node] = []
        node = parent
        for key, block_id in zip(keys, new_ids, strict=True):
            self._serial += 1
            child = _Node(key=key, block_id=block_id, parent=node, serial=self._serial)
            child.ref_count = 1
            node.children[key] = child
            self._nodes[block_id] = child
            new_nodes.append(child)
            node = child
        return new_nodes

    def _hold(self, path: list[_Node]) -> None:
        for node in path:
            if node.ref_count == 0:
                self._num_evictable -= 1
            node.ref_count += 1
        self._stamp(path)

    def _keys(self, token_ids: Sequence[int], num_blocks: int, first: int = 0) -> Iterator[tuple[int, ...]]:
        """The keys of blocks ``first`` to ``first + num_blocks`` of ``token_ids``."""
        size = self.block_size
        for index in range(first, first + num_blocks):
            yield tuple(token_ids[index * size:(index + 1) * size])

    def _path(self, blocks: Sequence[int]) -> list[_Node]:
        """The nodes of ``blocks``, checked to be cached and to form a path from the root."""
        path: list[_Node] = []
        parent: _Node | None = None  # the first block's: any root
        for block_id in blocks:
            node = self._nodes.get(block_id)
            if node is None:
                raise ValueError(f"block {block_id} is not cached")
            if node.parent is not parent and (parent is not None or node.parent is None or
                                              node.parent.parent is not None):
                raise ValueError(f"blocks {list(blocks)[:8]} do not form a path from the root")
            path.append(node)
            parent = node
        return path

    def _stamp(self, path: list[_Node]) -> None:
        """Mark a root path as used now. Only its last node can be a leaf, so only it is offered."""
        if not path:
            return
        self._clock += 1
        for node in path:
            node.last_used = self._clock
        self._offer(path[-1])

    def _offer(self, node: _Node) -> None:
        if node.parent is None or not node.evictable_leaf:
            return
        heapq.heappush(self._heap, (node.last_used, node.serial, node))
        if len(self._heap) > 2 * len(self._nodes) + 64:
            self._heap = [(n.last_used, n.serial, n) for n in self._nodes.values() if n.evictable_leaf]
            heapq.heapify(self._heap)

    def _walk_all(self) -> Iterator[_Node]:
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


def _int32s(token_ids: Sequence[int]) -> array[int]:
    """Token ids as an int32 array, kept and compared in C (a request's prompt already is one: sliced,
    not turned into a list of a Python int per id)."""
    return token_ids if isinstance(token_ids, array) else array("i", token_ids)
