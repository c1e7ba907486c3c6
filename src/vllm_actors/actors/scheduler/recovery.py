"""What a restart elsewhere in the group does to the scheduler's requests ("let it crash").

``RecoverPipeline`` (the supervisor restarted the KV-cache manager or a worker, whose state is
gone) resets the pipeline (``Scheduler.handle``): every running request is preempted (to the front
of the waiting queue, in its order, keeping its prompt and outputs: it resumes by recompute), the
plans in flight are forgotten (no token of theirs is counted, ``num_pending`` is zeroed
everywhere), the block ledger starts over (every block free, the prefix cache empty),
``PIPELINE_RESET`` is published and the next plan resets the pipeline (``pipeline``). A new
scheduler starts in that state, its step ids above its predecessors' (``first_step_id``).

After a scheduler restart the clients resubmit their unfinished requests (``AddRequest.resume``)
with the outputs they received: such a request enters as a preempted one; a resubmission of an id
already held is answered with the tokens its sender lacks (``catch_up``).
"""

from __future__ import annotations

from collections.abc import Iterable

from vllm_actors.actors.scheduler.request import ScheduledRequest, Status, check_stop
from vllm_actors.protocol.events import Finished, Preempted
from vllm_actors.protocol.messages import AddRequest, Message, RequestUpdate, RequestUpdates
from vllm_actors.protocol.names import FRONTEND


def start_over(running: list[ScheduledRequest], requests: Iterable[ScheduledRequest],
               step_id: int) -> list[Preempted]:
    """Every running request back to waiting (``PREEMPTED`` in batch order, the events returned),
    and no request's progress known any more: nothing computed, nothing in flight, nothing in the
    worker. Leaves the queues to the caller."""
    events = []
    for request in running:
        events.append(Preempted(request_id=request.request_id, step_id=step_id,
                                num_computed_tokens=request.num_computed_tokens))
        request.status = Status.WAITING
        request.num_preemptions += 1
    for request in requests:  # waiting ones too: their tokens in flight are lost
        request.num_computed_tokens = 0
        request.num_pending = request.num_pending_drafts = 0
        request.in_worker = False
        request.cache_check_at = 0
    return events


def ended_by_its_outputs(request: ScheduledRequest, max_model_len: int) -> tuple[Finished, RequestUpdates] | None:
    """A resubmission whose last output token already ends it: its ``FINISHED`` and the update that
    tells its sender; None for any other request."""
    if not request.output_token_ids:
        return None
    finish_reason, stop_reason = check_stop(request, request.output_token_ids[-1], max_model_len)
    if finish_reason is None:
        return None
    num_prompt = len(request.prompt_token_ids)
    finished = Finished(request_id=request.request_id, reason=finish_reason, num_prompt_tokens=num_prompt,
                        num_output_tokens=len(request.output_token_ids), stop_reason=stop_reason)
    update = RequestUpdate(request_id=request.request_id, finish_reason=finish_reason, stop_reason=stop_reason,
                           num_prompt_tokens=num_prompt)
    return finished, RequestUpdates(step_id=-1, updates=[update])


def catch_up(request: ScheduledRequest, resubmission: AddRequest) -> list[tuple[str, Message]]:
    """A resubmission of a request this scheduler runs (its sender restarted, a replica set's
    controller say): the tokens its sender lacks, from where its own tokens end, when they are a
    prefix of this copy's; nothing otherwise (the original is here already)."""
    have = list(resubmission.output_token_ids)
    ours = request.output_token_ids
    if len(have) >= len(ours) or ours[: len(have)] != have:
        return []
    update = RequestUpdate(request_id=request.request_id, new_token_ids=ours[len(have):], output_index=len(have),
                           num_prompt_tokens=len(request.prompt_token_ids))
    return [(FRONTEND, RequestUpdates(step_id=-1, updates=[update]))]
