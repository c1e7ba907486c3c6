"""Token ids as the wire carries them in bulk: little-endian int32, packed (``AddRequest.packed_prompt``,
``NewRequest.token_ids``), and read back without a Python int per token until one is used."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

import numpy as np


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as the wire carries them in bulk: little-endian int32, packed (a copy in C, where
    a msgpack list costs a Python int per token to encode and to decode)."""
    packed = array("i", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def token_id_array(data: bytes) -> array[int]:
    """Packed token ids as an int32 array (a copy in C: no Python int per token until one is read)."""
    if len(data) % 4:
        raise ValueError(f"packed token ids take 4 bytes each, got {len(data)} bytes")
    unpacked = array("i")
    unpacked.frombytes(data)
    if sys.byteorder != "little":
        unpacked.byteswap()
    return unpacked


def packed_id_range(data: bytes) -> tuple[int, int] | None:
    """The smallest and largest of packed token ids (None: none), read in place by numpy: a million
    in a millisecond, where min/max over a list of them take tens."""
    ids = np.frombuffer(data, dtype="<i4")
    return (int(ids.min()), int(ids.max())) if ids.size else None


def unpack_token_ids(data: bytes) -> list[int]:
    return token_id_array(data).tolist()
