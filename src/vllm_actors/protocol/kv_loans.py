"""Borrowing KV capacity across the replicas of a data-parallel set: the controller's messages to a
lender's scheduler (the events the lender's KV-cache manager publishes are ``KvLent`` and
``KvReturned`` in ``protocol/events.py``). No torch here."""

from __future__ import annotations

import msgspec

# A loan's key in the lender's block ledger: a request id cannot start with it (``names``), so a
# loan never meets one of the lender's own requests there.
LOAN_PREFIX = "\x00loan:"


class LendKv(msgspec.Struct, tag="lend_kv", kw_only=True):
    """Controller -> a lender's scheduler: reserve ``num_blocks`` of its pool for ``request_id``,
    whose home is replica ``home``. The blocks are taken before any waiting request of the lender
    is admitted, and are never evicted or preempted for its own requests."""

    request_id: str
    home: int
    num_blocks: int


class ReturnKv(msgspec.Struct, tag="return_kv", kw_only=True):
    """Controller -> a lender's scheduler: the request ended (finished or aborted); its reserved
    blocks go back to the lender's free pool."""

    request_id: str


def loan_key(request_id: str) -> str:
    return LOAN_PREFIX + request_id
