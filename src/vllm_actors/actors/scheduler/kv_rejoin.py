"""A KV-parallel rank restarted alone, as the scheduler sees it (``RecoverPipeline`` with
``kv_rank``): the running requests keep their blocks and their KV on the surviving ranks.

The plans in flight are forgotten: each running request's computed count goes back by the tokens
they gave it, and nothing is pending any more (``roll_back``). A block cached at planning time for
a forgotten step keeps its place in the prefix cache: its tokens are known, so the request's
computed count moves to the end of its cached blocks and the rejoin step recomputes those
positions on every rank (``recompute_from``) besides the dead rank's share of the rest. The
next plan carries the ``KvRejoin``: every rank re-seeds its requests from it (``actors/worker/kv_rejoin.py``).
Its pass (``planning_pass``) evicts the idle cached blocks first (some lived on the dead rank; this
side does not know which) and preempts nobody; the snapshot drops whoever the plan lets go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.request import ScheduledRequest, Status
from vllm_actors.protocol.messages import KvRejoin, StepPlan


def roll_back(forgotten: Sequence[StepPlan], requests: Mapping[str, ScheduledRequest]) -> None:
    """Each running request's computed count less the tokens the forgotten plans (oldest first)
    gave it since it entered the worker last (plans before its latest admission counted for an
    earlier stay, preempted since); nothing pending for anyone."""
    admitted: set[str] = set()
    for plan in reversed(forgotten):
        for request_id, num_new in zip(plan.req_ids, plan.num_tokens, strict=True):
            request = requests.get(request_id)
            if request is not None and request.status is Status.RUNNING and request_id not in admitted:
                request.num_computed_tokens -= num_new
        admitted.update(new.request_id for new in plan.new_requests)
    for request in requests.values():
        request.num_pending = request.num_pending_drafts = 0


def rejoin_of(rank: int, rendezvous: str, running: Iterable[ScheduledRequest], ledger: BlockLedger) -> KvRejoin:
    """The rejoin the next plan carries: every running request as the workers must hold it (its
    computed count at least the end of its cached blocks, recomputed from its rolled-back count)."""
    rejoin = KvRejoin(rank=rank, init_method=rendezvous)
    for request in running:
        rolled_back = request.num_computed_tokens
        # short of its last known token, which its next step computes and samples from
        cached_end = min(ledger.num_cached_front(request.request_id) * ledger.block_size, request.num_tokens - 1)
        request.num_computed_tokens = max(rolled_back, cached_end)
        rejoin.requests.append(request.new_request(request.num_computed_tokens, 0))
        rejoin.recompute_from.append(rolled_back)
        request.cache_check_at = 0  # look at its blocks again (nothing new is cached below its front)
    return rejoin


def without_departed(rejoin: KvRejoin, departed: Iterable[str]) -> KvRejoin:
    """``rejoin`` less the requests its own plan lets go (``finished_ids``: preempted or aborted
    since the snapshot, in the plan's pass or before it went out): the KV-cache manager frees their
    tables before it fills the rejoin's, so the ranks must not re-seed them."""
    gone = set(departed)
    if not gone:
        return rejoin
    kept = [index for index, new in enumerate(rejoin.requests) if new.request_id not in gone]
    return KvRejoin(rank=rejoin.rank, init_method=rejoin.init_method,
                    requests=[rejoin.requests[index] for index in kept],
                    recompute_from=[rejoin.recompute_from[index] for index in kept] if rejoin.recompute_from else [])
