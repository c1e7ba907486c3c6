"""Block hashes: part of the wire contract. The scheduler names cached blocks by these hashes in
its plans (``StepPlan.cached_hashes``, ``evicted_hashes``, ``NewRequest.cached_block_hash``), the
KV-cache manager keys its cache by them, and the block events carry them, so a router outside the
engine can mirror the prefix cache from the events alone."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0  # the parent hash of a sequence's first block (of the base model: see root_hash)


def root_hash(lora_int_id: int = 0) -> int:
    """The parent hash of the first block of a request with LoRA adapter ``lora_int_id`` (0: none,
    ``ROOT_HASH``): each adapter's blocks hash apart, so two adapters never share a block. blake2b
    with an 8-byte digest and the personalisation ``lora`` over the id (8 bytes, little-endian)."""
    if lora_int_id == 0:
        return ROOT_HASH
    data = struct.pack("<Q", lora_int_id)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=b"lora").digest(), "little")


def block_hash(parent_hash: int, token_ids: Sequence[int]) -> int:
    """The block's hash: blake2b with an 8-byte digest over the parent's hash (8 bytes,
    little-endian, unsigned) followed by each token id (4 bytes, little-endian, unsigned), the
    digest read as a little-endian unsigned int. The root's hash is ``ROOT_HASH`` (0)."""
    try:
        data = struct.pack(f"<Q{len(token_ids)}I", parent_hash, *token_ids)
    except struct.error as error:
        raise ValueError(f"cannot hash block {list(token_ids)[:8]} under {parent_hash}: {error}") from error
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
