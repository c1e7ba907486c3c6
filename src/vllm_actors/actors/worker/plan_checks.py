"""What a worker refuses in a step plan (``MessageRejected``), checked before any state changes:
lengths that disagree, requests it does not hold, more tokens than a request has pending, blocks
outside the pool or beyond a sequence's table, token ids that are not packed 4 bytes each, and a
constrained request where the worker has no grammars."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from vllm_actors.protocol.block_runs import iter_runs
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.messages import StepPlan


class HeldRequest(Protocol):
    """What the checks read of a request the worker holds (``worker.WorkerRequest``)."""

    num_computed_tokens: int
    token_ids: list[int]
    num_pending: int
    block_table: list[int]


def check_plan(plan: StepPlan, held: Mapping[str, HeldRequest], *, has_grammars: bool, num_blocks: int | None,
               table_width: int | None, num_host_blocks: int = 0) -> None:
    """Raise ``MessageRejected`` naming what is wrong with ``plan``; ``held``: the worker's requests
    (a reset plan starts from none), ``num_blocks``: the KV pool's size, ``table_width``: the most
    blocks one sequence's table takes (None: not checked), ``num_host_blocks``: the host tier's."""
    if not len(plan.req_ids) == len(plan.num_tokens) == len(plan.new_block_ids):
        raise MessageRejected("req_ids, num_tokens and new_block_ids differ in length")
    _check_copies(plan, num_blocks, num_host_blocks)
    held_requests: Mapping[str, HeldRequest] = {} if plan.reset else held
    for request_id, keep in plan.trimmed_blocks.items():
        if request_id not in held_requests or request_id in plan.finished_ids:
            raise MessageRejected(f"plan trims {request_id!r}, which this worker does not hold")
        if not 0 <= keep <= len(held_requests[request_id].block_table):
            raise MessageRejected(f"plan trims {request_id!r} to {keep} blocks, it holds fewer")
    if not set(plan.draft_token_ids) <= set(plan.req_ids):
        raise MessageRejected("draft_token_ids names a request that is not scheduled")
    computed = {
        request_id: (request.num_computed_tokens, len(request.token_ids) + request.num_pending)
        for request_id, request in held_requests.items()
        if request_id not in plan.finished_ids
    }
    for new in plan.new_requests:
        if len(new.token_ids) % 4:
            raise MessageRejected(f"new request {new.request_id!r}: packed token ids take 4 bytes each")
        if new.params.structured_outputs is not None and not has_grammars:
            raise MessageRejected(f"new request {new.request_id!r}: structured outputs need grammars")
    computed.update({new.request_id: (new.num_cached_tokens, new.num_tokens) for new in plan.new_requests})
    new_ids = {new.request_id for new in plan.new_requests}
    for request_id, num_new, blocks in zip(plan.req_ids, plan.num_tokens, plan.new_block_ids, strict=True):
        if request_id not in computed:
            raise MessageRejected(f"plan schedules unknown request {request_id!r}")
        done, known = computed[request_id]
        drafts = plan.draft_token_ids.get(request_id, ()) if plan.draft_token_ids else ()
        if not 1 <= num_new - len(drafts) <= known - done:
            raise MessageRejected(f"plan schedules {num_new} tokens for {request_id!r}, {known - done} pending")
        if drafts and done + num_new - len(drafts) != known:
            raise MessageRejected(f"plan drafts for {request_id!r} before its last token")
        _check_blocks(request_id, blocks, num_blocks)
        fresh = request_id in plan.finished_ids or request_id not in held_requests or request_id in new_ids
        already = 0 if fresh else len(held_requests[request_id].block_table)
        if table_width is not None and already + len(blocks) > table_width:
            raise MessageRejected(f"plan gives {request_id!r} more blocks than a sequence may hold")


def _check_copies(plan: StepPlan, num_blocks: int | None, num_host_blocks: int) -> None:
    """Block copies between the pool and the host tier: runs of three, inside both."""
    if plan.write_through_copies and not plan.req_ids:
        raise MessageRejected("plan writes blocks through to the host tier without a step to compute them")
    try:
        offloads = list(iter_runs(plan.offload_copies)) + list(iter_runs(plan.write_through_copies))
        restores = [(block, slot, count) for slot, block, count in iter_runs(plan.restore_copies)]
    except ValueError as error:
        raise MessageRejected(str(error)) from None
    if (offloads or restores) and not num_host_blocks:
        raise MessageRejected("plan copies blocks to or from a host tier, and this worker has none")
    pool = num_blocks if num_blocks is not None else 2**62
    for block, slot, count in offloads + restores:
        if count < 1 or block < 0 or slot < 0 or block + count > pool or slot + count > num_host_blocks:
            raise MessageRejected(f"plan copies blocks outside the pool or the host tier: ({block}, {slot}, {count})")


def _check_blocks(request_id: str, blocks: Sequence[int], num_blocks: int | None) -> None:
    if num_blocks is not None and any(not 0 <= block < num_blocks for block in blocks):
        raise MessageRejected(f"plan gives {request_id!r} a block outside the pool")
