"""N-gram drafts (prompt lookup, vLLM's ``ngram`` method): the tokens that followed the latest
earlier occurrence of the request's last n tokens, for n from ``max_n`` down to ``min_n``; the latest
occurrence followed by as many tokens as the drafts asked for where there is one. (The latest
occurrence is often in the text just written, a copy of the prompt, and its continuation runs into
the end: on the copying workload of ``benchmarks/spec_decode.py``, SmolLM2-135M, k = 7, the latest
found 4.0 drafts a lookup and 2.87 tokens a step with every lookup verified; the latest full one 6.7
and 3.74.)

The search runs over the tokens packed as int32 bytes (``bytes.rfind`` in C), so a request with a
long context costs a memchr-speed scan per step, not a Python loop over its tokens.
"""

from __future__ import annotations

from vllm_actors.protocol.token_ids import pack_token_ids, unpack_token_ids


def propose_ngram(packed: bytes, num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``num_drafts`` tokens to try after the tokens in ``packed`` (``pack_token_ids``):
    those that followed the latest earlier match of its longest matching suffix of ``min_n`` to
    ``max_n`` tokens. Empty when no suffix of at least ``min_n`` tokens occurs earlier."""
    num_tokens = len(packed) // 4
    if num_drafts < 1 or num_tokens < min_n + 1:
        return []
    longest = min(max_n, num_tokens - 1)
    if longest > min_n and latest_match(packed, min_n) < 0:
        return []  # a longer suffix ends with the shortest: none occurs earlier (most lookups: one scan, not one per n)
    for n in range(longest, min_n - 1, -1):
        found = latest_match(packed, n)
        if found >= 0:
            if num_drafts > 1 and (found + 4 * (n + num_drafts) > len(packed)):  # cut short by the end
                full = latest_match(packed, n, following=num_drafts)
                found = full if full >= 0 else found
            start = found + 4 * n
            return unpack_token_ids(packed[start : start + 4 * num_drafts])
    return []


def latest_match(packed: bytes, n: int, following: int = 1) -> int:
    """The byte offset of the latest earlier occurrence of the last ``n`` tokens followed by at least
    ``following`` tokens, aligned on a token; -1 where there is none."""
    suffix = packed[-4 * n:]
    end = len(packed) - 4 * (following - 1) - 1  # the suffix itself does not count: a match starts before it
    if end < 4 * n:
        return -1
    while True:
        found = packed.rfind(suffix, 0, end)
        if found < 0 or found % 4 == 0:  # none, or aligned on a token
            return found
        end = found + 4 * n - 1  # an unaligned hit: look further back


def propose_for(token_ids: list[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """``propose_ngram`` over a token list (tests and callers without a packed copy)."""
    return propose_ngram(pack_token_ids(token_ids), num_drafts, min_n, max_n)
