"""A prefix-cached block as the KV-cache manager indexes it: its block id and its parent's hash."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CacheEntry:
    block_id: int
    parent_hash: int
