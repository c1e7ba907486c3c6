"""Borrowing KV capacity across a replica set: where a request too long for one replica's pool goes.
Pure: no sockets, no clock.

The controller mirrors every replica's pool from its KV-cache manager's ``KV_POOL`` events (size
and free blocks), and each loan's confirmation from ``KV_LENT``. A request whose whole context
(prompt, outputs so far, then ``max_tokens`` or up to ``max_model_len``) needs more blocks than
some replica's pool holds is *placed*: on a *home* replica (the largest pool, then the most free
blocks, then the fewest requests in flight), which runs the model, plus *lenders*, which hold the
rest of its blocks, each a block count (no lender when it fits the home's pool).

A share is at most a pool less ``keep_free`` of it (a lender keeps room for its own requests'
growth; the home too, for its other requests). Lenders are taken most free first (their free
blocks, less the loans promised to them and not yet confirmed), as few as hold the request with the
home's share; the request is then spread over the home and them in proportion to their shares, so
that each keeps the same part of its pool for its own short requests and attends the same part of
the long one (two H200s: a home that kept 90% of its pool for a 300k-token request left its own
requests 10%, and their TTFT p99 reached 260 s). A lender's blocks not free yet are granted as its
running requests end (it takes a reservation before admitting any new request of its own). A
request whose blocks exceed every share together fits nowhere, even borrowing: ``LoanRefused`` (a
``ValueError``) says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_actors.protocol.events import KvLent, KvPool, KvReturned

DEFAULT_KEEP_FREE = 0.1  # of a pool that a share leaves for the replica's own requests


class LoanRefused(ValueError):
    """The request fits in no replica's pool, nor in every replica's share of them together."""


@dataclass(frozen=True)
class Placement:
    """A borrowing request's replicas: ``home`` runs it and holds ``home_blocks`` of its KV;
    ``lenders`` maps each lender replica to the blocks it reserves (in the order chosen)."""

    home: int
    home_blocks: int
    lenders: dict[int, int]

    @property
    def num_blocks(self) -> int:
        return self.home_blocks + sum(self.lenders.values())


@dataclass
class PoolMirror:
    """One replica's pool as its events tell it (``num_blocks`` 0: not heard of yet)."""

    num_blocks: int = 0
    num_free: int = 0
    promised: dict[str, int] = field(default_factory=dict)  # loans sent, not confirmed by KV_LENT yet
    lent: dict[str, int] = field(default_factory=dict)  # loans confirmed: request id -> blocks

    @property
    def num_available(self) -> int:
        return max(self.num_free - sum(self.promised.values()), 0)


class LoanPlanner:
    def __init__(self, num_replicas: int, block_size: int, max_model_len: int, *, num_blocks: int = 0,
                 keep_free: float = DEFAULT_KEEP_FREE) -> None:
        """``num_blocks``: each replica's pool until its first ``KV_POOL`` (0: unknown, nothing is
        placed until heard); ``keep_free``: the fraction of a pool a share leaves, in [0, 1)."""
        if not 0 <= keep_free < 1:
            raise ValueError(f"keep_free must be in [0, 1), got {keep_free}")
        if block_size < 1 or max_model_len < 1:
            raise ValueError(f"block_size ({block_size}) and max_model_len ({max_model_len}) must be >= 1")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.keep_free = keep_free
        self.pools = [PoolMirror(num_blocks, num_blocks) for _ in range(num_replicas)]
        self.placements: dict[str, Placement] = {}

    # ------------------------------------------------------------------ what it hears
    def observe(self, replica: int, event: object) -> None:
        pool = self.pools[replica]
        if isinstance(event, KvPool):
            pool.num_blocks, pool.num_free = event.num_blocks, event.num_free
        elif isinstance(event, KvLent):
            pool.lent[event.request_id] = pool.promised.pop(event.request_id, len(event.block_ids))
            pool.num_free = event.num_free_blocks
        elif isinstance(event, KvReturned):
            pool.lent.pop(event.request_id, None)
            pool.num_free = event.num_free_blocks

    def pool_lost(self, replica: int) -> None:
        """The replica's KV-cache manager restarted: a fresh pool, where its scheduler reserves
        the loans it had granted again (promised until their ``KV_LENT``)."""
        pool = self.pools[replica]
        pool.promised.update(pool.lent)
        pool.lent.clear()
        pool.num_free = pool.num_blocks

    # ------------------------------------------------------------------ decisions
    def blocks_needed(self, num_prompt: int, num_outputs: int, max_tokens: int | None) -> int:
        """Blocks of the request's whole context: what it has, then what it may still produce."""
        limit = self.max_model_len if max_tokens is None else min(num_prompt + max(max_tokens, num_outputs),
                                                                  self.max_model_len)
        return math.ceil(max(limit, num_prompt + num_outputs) / self.block_size)

    def share(self, replica: int) -> int:
        pool = self.pools[replica]
        return pool.num_blocks - math.ceil(self.keep_free * pool.num_blocks)

    def place(self, request_id: str, num_blocks: int, candidates: Sequence[int],
              in_flight: Sequence[int]) -> Placement | None:
        """None when the request fits every pool of ``candidates`` (the replicas up: the router
        decides) or a pool is not known yet; else its placement over them, recorded, with the
        lenders' blocks promised (no lenders when it fits the home's pool). Raises
        ``LoanRefused`` when it fits nowhere."""
        pools = self.pools
        if not candidates:
            raise ValueError("no replica to place the request on")
        if any(pool.num_blocks == 0 for pool in pools) or num_blocks <= min(pools[r].num_blocks for r in candidates):
            return None
        home = min(candidates, key=lambda r: (-pools[r].num_blocks, -pools[r].num_available, in_flight[r], r))
        if num_blocks <= pools[home].num_blocks:
            return Placement(home, num_blocks, {})
        others = sorted((r for r in candidates if r != home), key=lambda r: (-pools[r].num_available, r))
        total = self.share(home) + sum(self.share(r) for r in others)
        if total < num_blocks:
            sizes = ", ".join(f"replica {r}: {pools[r].num_blocks}" for r in sorted(candidates))
            raise LoanRefused(
                f"request {request_id!r} needs {num_blocks} KV blocks ({num_blocks * self.block_size} tokens), "
                f"more than the replicas can hold together even by borrowing: {total} blocks "
                f"(each replica's pool less {self.keep_free:.0%} kept for its own requests; pools: {sizes})"
            )
        chosen, held = [home], self.share(home)
        for replica in others:  # the fewest lenders, most free first, that hold it with the home
            if held >= num_blocks:
                break
            chosen.append(replica)
            held += self.share(replica)
        counts = spread(num_blocks, [self.share(r) for r in chosen])
        lenders = {replica: count for replica, count in zip(chosen[1:], counts[1:], strict=True) if count}
        placement = Placement(home, counts[0], lenders)
        self.placements[request_id] = placement
        for replica, count in lenders.items():
            pools[replica].promised[request_id] = count
        return placement

    def release(self, request_id: str) -> Placement | None:
        """The request ended: its placement, whose lenders get their blocks back (None: it had none)."""
        placement = self.placements.pop(request_id, None)
        if placement is not None:
            for replica in placement.lenders:
                self.pools[replica].promised.pop(request_id, None)
        return placement


def spread(num_blocks: int, shares: Sequence[int]) -> list[int]:
    """``num_blocks`` over participants in proportion to their ``shares`` (largest remainders first, the
    earlier on a tie), none above its share; ``num_blocks`` must not exceed their sum."""
    total = sum(shares)
    exact = [num_blocks * share / total for share in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[:num_blocks - sum(counts)]:
        counts[i] += 1
    return counts
