"""Borrowing KV capacity across the replicas of a data-parallel set: the controller's messages to a
lender's scheduler (the events the lender's KV-cache manager publishes are ``KvLent`` and
``KvReturned`` in ``protocol/events.py``). No torch here."""

from __future__ import annotations

from typing import Any

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


class BorrowKv(msgspec.Struct, tag="borrow_kv", kw_only=True):
    """Controller -> the home's scheduler, right before the request's ``AddRequest``: the request
    runs with ``lenders`` holding the front of its KV table, each ``[replica, blocks]`` in table
    order (its own blocks follow them)."""

    request_id: str
    lenders: list[list[int]]


def kv_borrowing_error(config: Any) -> str | None:
    """What is wrong with ``kv_borrowing`` in an ``EngineConfig``, or None: the combinations not
    supported yet are refused by name."""
    if not config.kv_borrowing:
        return None
    for name in ("tensor_parallel_size", "pipeline_parallel_size", "kv_parallel_size"):
        if getattr(config, name) > 1:
            return f"kv_borrowing with {name} {getattr(config, name)} is not supported yet: use it with 1"
    if config.data_parallel_size < 2:
        return "kv_borrowing borrows KV blocks across the replicas of a set: it needs data_parallel_size > 1"
    if config.distributed_executor_backend != "mp":
        return (f"kv_borrowing with distributed_executor_backend {config.distributed_executor_backend!r} is not "
                "supported yet: use 'mp' (the replicas of one host)")
    if config.kv_cache_dtype != "auto" or config.speculative_config is not None or config.enable_lora:
        return "kv_borrowing with an fp8 KV cache, speculative_config or enable_lora is not supported yet"
    if config.disable_events:
        return "kv_borrowing needs the KV-cache managers' events (the controller follows the pools and loans by them)"
    if config.kv_cache_offload_gb:
        return "kv_borrowing with kv_cache_offload_gb is not supported yet (set it to 0)"
    return None


def loan_key(request_id: str) -> str:
    return LOAN_PREFIX + request_id
