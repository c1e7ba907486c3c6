"""The plan's ``WORKER_DRAFT`` placeholders: which requests the worker drafts for, and the plan
with their drafts filled in (the n-gram lookup's, a draft model's, an EAGLE-3 head's)."""

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


def with_drafts(plan: StepPlan, work: list[DraftWork], proposals: list[list[int]]) -> StepPlan:
    """The plan with each placeholder list replaced by its proposal. A proposal shorter than its
    placeholders takes that many fewer tokens (no filler is verified); an empty one leaves its
    request a plain decode row, and with no drafts left the plan is a plain step."""
    filled = dict(plan.draft_token_ids)
    num_tokens = list(plan.num_tokens)
    index = {request_id: row for row, request_id in enumerate(plan.req_ids)}
    for item, drafted in zip(work, proposals, strict=True):
        request_id = item.request.request_id
        if len(drafted) > item.num_drafts:
            raise ValueError(f"{request_id}: {len(drafted)} drafts proposed for {item.num_drafts} placeholders")
        num_tokens[index[request_id]] -= item.num_drafts - len(drafted)
        if drafted:
            filled[request_id] = drafted
        else:
            del filled[request_id]
    return msgspec.structs.replace(plan, draft_token_ids=filled, num_tokens=num_tokens)


def short_drafts(planned: StepPlan, filled: StepPlan) -> dict[str, int]:
    """The requests that draft fewer tokens than their plan's placeholders: their drafts' count
    (``StepResult.num_drafted``: the scheduler still rolls the planned slots back)."""
    return {request_id: len(filled.draft_token_ids.get(request_id, ()))
            for request_id, drafts in planned.draft_token_ids.items()
            if len(filled.draft_token_ids.get(request_id, ())) < len(drafts)}
