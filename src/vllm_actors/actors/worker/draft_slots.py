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
    filled = dict(plan.draft_token_ids)
    for item, drafted in zip(work, proposals, strict=True):
        filled[item.request.request_id] = drafted
    return msgspec.structs.replace(plan, draft_token_ids=filled)
