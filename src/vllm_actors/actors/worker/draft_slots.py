"""The plan's ``WORKER_DRAFT`` placeholders: which requests the worker drafts for, and the plan
with their drafts filled in (the n-gram lookup's, a draft model's, an EAGLE-3 head's), or cut where
a constrained request's grammar refuses one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.speculative import WORKER_DRAFT

if TYPE_CHECKING:  # the type only: the n-gram proposer runs without torch
    from vllm_actors.actors.worker.step_data import WorkerRequest


@dataclass
class DraftWork:
    """A drafting request of a plan (a draft model's or an EAGLE-3 head's)."""

    request: WorkerRequest
    table: list[int]  # its block table with this step's new blocks
    length: int  # its known tokens (the last one's logits give the first draft)
    num_drafts: int


def drafting_work(plan: StepPlan, requests: Mapping[str, WorkerRequest]) -> list[DraftWork]:
    """The plan's requests whose drafts are ``WORKER_DRAFT`` placeholders."""
    if not plan.draft_token_ids:  # a plain step: nothing per request
        return []
    new_blocks = dict(zip(plan.req_ids, plan.new_block_ids, strict=True))
    work: list[DraftWork] = []
    for request_id, drafts in plan.draft_token_ids.items():
        if not drafts or drafts[0] != WORKER_DRAFT:
            continue
        request = requests[request_id]
        work.append(DraftWork(request, request.block_table + list(new_blocks[request_id]), len(request.token_ids),
                              len(drafts)))
    return work


def placeholder_counts(plan: StepPlan) -> dict[str, int]:
    """The plan's requests whose drafts are ``WORKER_DRAFT`` placeholders, and how many each
    (``drafting_work`` less the block tables: the n-gram lookup needs none)."""
    return {request_id: len(drafts) for request_id, drafts in plan.draft_token_ids.items()
            if drafts and drafts[0] == WORKER_DRAFT}


def with_drafts(plan: StepPlan, work: list[DraftWork], proposals: list[list[int]]) -> StepPlan:
    """The plan with each placeholder list replaced by its proposal. A proposal shorter than its
    placeholders takes that many fewer tokens (no filler is verified); an empty one leaves its
    request a plain decode row, and with no drafts left the plan is a plain step."""
    counts = {item.request.request_id: item.num_drafts for item in work}
    return with_found(plan, counts, {item.request.request_id: drafted
                                     for item, drafted in zip(work, proposals, strict=True) if drafted})


def with_found(plan: StepPlan, counts: dict[str, int], found: dict[str, list[int]]) -> StepPlan:
    """``with_drafts`` given each placeholder request's count (``placeholder_counts``) and only the
    non-empty proposals (``found``): the requests of ``counts`` missing there draft nothing."""
    filled = dict(plan.draft_token_ids)
    num_tokens = list(plan.num_tokens)
    index = dict(zip(plan.req_ids, range(len(plan.req_ids))))
    for request_id, num_drafts in counts.items():
        drafted = found.get(request_id)
        if drafted is None:
            num_tokens[index[request_id]] -= num_drafts
            del filled[request_id]
            continue
        if len(drafted) > num_drafts:
            raise ValueError(f"{request_id}: {len(drafted)} drafts proposed for {num_drafts} placeholders")
        num_tokens[index[request_id]] -= num_drafts - len(drafted)
        filled[request_id] = drafted
    return msgspec.structs.replace(plan, draft_token_ids=filled, num_tokens=num_tokens)


def grammar_checked(plan: StepPlan, requests: Mapping[str, WorkerRequest]) -> StepPlan:
    """The plan with each constrained request's drafts cut before the first its grammar refuses
    (none left: a plain row), so that every verification row has a grammar state to mask from;
    the plan itself where nothing is cut."""
    counts: dict[str, int] = {}
    found: dict[str, list[int]] = {}
    for request_id, drafts in plan.draft_token_ids.items():
        grammar = requests[request_id].grammar
        if grammar is None or not drafts:
            continue
        valid = grammar.valid_drafts(drafts)
        if valid < len(drafts):
            counts[request_id] = len(drafts)
            if valid:
                found[request_id] = list(drafts[:valid])
    return with_found(plan, counts, found) if counts else plan


def short_drafts(planned: StepPlan, filled: StepPlan) -> dict[str, int]:
    """The requests that draft fewer tokens than their plan's placeholders: their drafts' count
    (``StepResult.num_drafted``: the scheduler still rolls the planned slots back)."""
    now = filled.draft_token_ids
    return {request_id: count for request_id, drafts in planned.draft_token_ids.items()
            if (count := len(now.get(request_id, ()))) < len(drafts)}
