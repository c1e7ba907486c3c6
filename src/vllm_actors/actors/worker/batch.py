"""A step plan turned into the runner's flattened batch: each scheduled request's new tokens,
positions and block table, the logits rows to return (the sampled rows, and the prompt positions
of a request asking for prompt logprobs), and who samples."""

from __future__ import annotations

from collections.abc import Mapping

from vllm_actors.actors.worker.block_tables import BlockTableArray
from vllm_actors.actors.worker.step_data import (
    BatchInput,
    DeferredInputs,
    PendingStep,
    PromptSpan,
    StepBatch,
    WorkerRequest,
)
from vllm_actors.protocol.events import StepStarted
from vllm_actors.protocol.messages import StepPlan


def build_batch(plan: StepPlan, requests: Mapping[str, WorkerRequest], tables: BlockTableArray | None,
                pending: PendingStep | None = None) -> StepBatch:
    """The step's inputs (the requests' blocks and computed counts advance); a token the pending
    step sampled becomes a placeholder filled on the device from that step's sampled ids."""
    batch = BatchInput([], [], [], [], [], [])
    step = StepBatch(batch, [], [], [])
    deferred_index: list[int] = []
    deferred_row: list[int] = []
    source = pending.chosen if pending is not None else None
    no_drafts: list[int] = []
    for request_id, num_new, new_blocks in zip(plan.req_ids, plan.num_tokens, plan.new_block_ids, strict=True):
        request = requests[request_id]
        request.block_table.extend(new_blocks)
        if tables is not None:
            tables.append(request.row, new_blocks)
        start = request.num_computed_tokens
        drafts = plan.draft_token_ids.get(request_id, no_drafts) if plan.draft_token_ids else no_drafts
        end = start + num_new - len(drafts)  # the known tokens' end; the drafts follow
        known = len(request.token_ids)
        if end > known + request.num_pending or (drafts and request.num_pending):
            raise ValueError(f"{request_id}: asked to compute {end} tokens, {known} known")
        flat_start = len(batch.token_ids)
        batch.token_ids.extend(request.token_ids[start:end])
        batch.token_ids.extend(drafts)
        if end > known:  # the last input is the token the pending step sampled
            if pending is None or pending.chosen is None or request_id not in pending.row_of:
                raise ValueError(f"{request_id}: its last token is pending in no launched step")
            batch.token_ids.append(0)
            deferred_index.append(len(batch.token_ids) - 1)
            deferred_row.append(pending.row_of[request_id])
        batch.positions.extend(range(start, start + num_new))
        batch.query_lens.append(num_new)
        batch.seq_lens.append(start + num_new)
        batch.block_tables.append(request.block_table)
        if request.lora_request is not None and batch.loras is None:
            batch.loras = [None] * (len(batch.query_lens) - 1)
        if batch.loras is not None:
            batch.loras.append(request.lora_request)
        if request.wants_prompt_logprobs and start < request.num_prompt_tokens - 1:
            last = min(end, request.num_prompt_tokens - 1)
            step.spans.append(PromptSpan(request, len(batch.logits_indices), start + 1, last - start))
            batch.logits_indices.extend(range(flat_start, flat_start + last - start))
        request.num_computed_tokens = start + num_new  # verification rolls rejected drafts back
        if end == known + request.num_pending:
            step.samplers.append(request)
            if plan.draft_token_ids:
                step.drafts.append(drafts)
            for position in range(flat_start + num_new - 1 - len(drafts), flat_start + num_new):
                step.sample_rows.append(len(batch.logits_indices))
                batch.logits_indices.append(position)
    if deferred_index and source is not None:
        batch.deferred = DeferredInputs(deferred_index, source, deferred_row)
    if batch.token_ids and tables is not None:
        batch.table_rows = tables.rows_of([requests[request_id].row for request_id in plan.req_ids])
    return step


def step_started(plan: StepPlan) -> StepStarted:
    """The plan's STEP_STARTED event: its sequences, tokens and prefills."""
    return StepStarted(
        step_id=plan.step_id,
        num_seqs=len(plan.req_ids),
        num_tokens=sum(plan.num_tokens),
        num_prefill_seqs=sum(1 for new in plan.new_requests if new.request_id in plan.req_ids),
    )
