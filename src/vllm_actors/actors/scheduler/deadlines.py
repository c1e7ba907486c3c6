"""Deadline arithmetic on the cost model: a request's predicted remaining work (the ``lrs``
policy's slack) and admission control (``reject_unmeetable``: a request whose predicted finish,
the queue ahead of it plus its own work, misses its deadline is refused at arrival). No clock:
``now`` is the request's arrival time as its sender stamped it (``AddRequest.arrival_time``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from vllm_actors.actors.scheduler.cost_model import CostModel, StepFeatures, chunk_pairs, chunk_scan
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.protocol.errors import UNMEETABLE_DEADLINE as UNMEETABLE
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult


def remaining_prefill(request: ScheduledRequest) -> int:
    return max(0, request.num_tokens - request.num_computed_tokens)


def remaining_decodes(request: ScheduledRequest) -> int:
    max_tokens = request.params.max_tokens
    if max_tokens is None:
        return 1
    return max(0, max_tokens - len(request.output_token_ids))


def prefill_seconds(request: ScheduledRequest, cost: CostModel, batch: int) -> float:
    """Predicted time of its remaining prefill in one step, its attention over the context it
    already has included (a long prompt's last tokens cost more than its first)."""
    prefill = remaining_prefill(request)
    if not prefill:
        return 0.0
    start = request.num_computed_tokens
    return cost.step_seconds(prefill, batch, chunk_pairs(start, prefill), chunk_scan(start, prefill))


def first_token_seconds(request: ScheduledRequest, cost: CostModel, batch: int) -> float:
    """Predicted time to its first token: its prefill in one step (0 once it has a token)."""
    return 0.0 if request.output_token_ids else prefill_seconds(request, cost, batch)


def remaining_seconds(request: ScheduledRequest, cost: CostModel, batch: int) -> float:
    """Predicted time left to finish it: its prefill in one step, then one step per token in a
    batch of ``batch`` decoding sequences."""
    decodes = remaining_decodes(request)
    prefill = prefill_seconds(request, cost, batch)
    return prefill + max(0, decodes - (1 if prefill else 0)) * cost.step_seconds(0, batch)


def unmeetable_error(message: AddRequest, ahead: Iterable[ScheduledRequest], num_running: int,
                     cost: CostModel, budget: int, max_num_seqs: int) -> str | None:
    """Why the request cannot meet its deadline, or None (no deadline, no arrival time, or met).
    Its first token comes after every prefill token ahead of it and its own, ``budget`` tokens a
    step; then one decode step per further token in the batch it will share."""
    now = message.arrival_time
    if now is None or (message.ttft_deadline is None and message.e2e_deadline is None):
        return None
    ahead = list(ahead)
    prefill_tokens = sum(remaining_prefill(r) for r in ahead) + message.num_prompt_tokens
    batch = min(max_num_seqs, num_running + 1)
    steps = math.ceil(prefill_tokens / budget)
    pairs = chunk_pairs(0, message.num_prompt_tokens)  # its own attention; those ahead are apart
    ttft = steps * cost.step_seconds(0, batch) + cost.step_seconds(prefill_tokens, 0, pairs) - cost.step_seconds(0, 0)
    decodes = (message.params.max_tokens or 1) - 1
    e2e = ttft + decodes * cost.step_seconds(0, batch)
    for what, deadline, predicted in (("time to first token", message.ttft_deadline, ttft),
                                      ("end-to-end", message.e2e_deadline, e2e)):
        if deadline is not None and now + predicted > deadline:
            return (f"{UNMEETABLE}: predicted {what} {predicted * 1000:.1f} ms, target "
                    f"{(deadline - now) * 1000:.1f} ms ({len(ahead)} requests ahead)")
    return None


def step_features(plan: StepPlan, block_size: int) -> StepFeatures:
    """A step's cost-model features: its prefill tokens (requests given more than one token that
    verify no drafts), their attention work (``chunk_pairs`` and ``chunk_scan``; each chunk's context taken
    from the blocks its request holds, to within a block) and its decodes (one token each, or one and its
    drafts)."""
    drafts = plan.draft_token_ids
    prefill_tokens, num_decodes, pairs, scan = 0, 0, 0.0, 0.0
    for request_id, n, blocks in zip(plan.req_ids, plan.num_tokens, plan.num_blocks, strict=True):
        if n - len(drafts.get(request_id, ())) == 1:
            num_decodes += 1
        else:
            prefill_tokens += n
            start = max(0, blocks * block_size - n)
            pairs += chunk_pairs(start, n)
            scan += chunk_scan(start, n)
    return StepFeatures(prefill_tokens, num_decodes, pairs, scan)


def step_wall_seconds(result: StepResult) -> float:
    """The step's own share of the worker's wall time (``interval_seconds``: from the later of its launch
    and the previous step's read-back to its own read-back), what its decodes wait after their previous
    token; ``execute_seconds`` where the worker sent none. Not ``execute_seconds`` itself: a deferred step
    is launched before the previous one is read back, and its launch-to-read-back time holds the rest of
    the previous step (two 120 ms steps of a 1M-token prompt at 300k read 230 ms on the H200)."""
    return result.interval_seconds if result.interval_seconds > 0 else result.execute_seconds


def observe_step(cost: CostModel, plan: StepPlan, result: StepResult, block_size: int,
                 features: StepFeatures | None = None) -> None:
    """Teach the cost model one step (``step_features``, or ``features`` where the caller has
    them) and its wall share (``step_wall_seconds``; not measured where ``execute_seconds`` is 0).
    Steps that verify drafts teach the speculator's ``DraftCost`` instead."""
    if result.execute_seconds <= 0 or plan.draft_token_ids:
        return
    prefill_tokens, num_decodes, pairs, scan = features or step_features(plan, block_size)
    cost.observe(prefill_tokens, num_decodes, step_wall_seconds(result), pairs, scan)
