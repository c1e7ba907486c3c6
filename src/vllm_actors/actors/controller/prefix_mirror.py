"""A replica's prefix cache as seen from outside: the block hashes its KV-cache manager reported
cached and not evicted since, built only from ``BLOCK_CACHED`` / ``BLOCK_EVICTED`` events.

Block hashes chain (``protocol/block_hash.py``): block i's hash covers its parent's hash and its
own tokens, so a prompt's first k full blocks are cached exactly when the hashes of its first k
blocks all are. The longest cached prefix of a prompt is then the count of its leading block
hashes found in the set; no tree is needed. A pure state machine: no sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_actors.protocol.block_hash import ROOT_HASH, block_hash
from vllm_actors.protocol.events import BlockCached, BlockEvicted


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The hash chain of the prompt's full blocks, as the scheduler's prefix cache names them, up to
    the first block with an id no hash takes (negative, or 2**32 and above): the controller routes such
    a prompt on what it could hash, and the replica's scheduler refuses it, saying why."""
    hashes: list[int] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        try:
            parent = block_hash(parent, token_ids[start:start + block_size])
        except ValueError:
            break
        hashes.append(parent)
    return hashes


class PrefixMirror:
    """The cached block hashes of one replica."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()

    def __len__(self) -> int:
        return len(self.hashes)

    def apply(self, event: object) -> None:
        if isinstance(event, BlockCached):
            self.hashes.update(event.block_hashes)
        elif isinstance(event, BlockEvicted):
            self.hashes.difference_update(event.block_hashes)

    def clear(self) -> None:
        """The replica's pool is gone (its KV-cache manager restarted)."""
        self.hashes.clear()

    def match(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the chain are cached here."""
        count = 0
        for value in block_hashes:
            if value not in self.hashes:
                break
            count += 1
        return count
