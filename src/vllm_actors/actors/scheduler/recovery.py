"""Recovery (issue 12, "let it crash"). ``RecoverPipeline`` (the supervisor restarted the KV-cache
manager or a worker, whose state is gone) resets the pipeline: every running request is preempted
(to the front of the waiting queue, in its order, keeping its prompt and outputs: it resumes by
recompute), the plans in flight are forgotten (no token of theirs will be counted, ``num_pending``
is zeroed everywhere), the block ledger starts over (every block free, the prefix cache empty),
``PIPELINE_RESET`` is published and the next plan carries ``reset=True`` (sent even if it
schedules nothing), telling the KV-cache manager and the workers to drop everything first. Until
that plan's result (``StepResult.reset``, its step id) is back, every other result is stale and
ignored, as is any result of a step id below it afterwards. A new scheduler starts in that state:
its first plan is a reset, and its step ids start above its predecessors' (``first_step_id``, given
by the supervisor), so a dead scheduler's plan still in the pipeline never passes for its own.
After a scheduler restart the clients resubmit their unfinished requests (``AddRequest.resume``)
with the outputs they received: such a request enters as a preempted one; a resubmission of an id
already held is answered with the tokens its sender lacks (``catch_up``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.request import ScheduledRequest, Status
from vllm_actors.protocol.events import PipelineReset, Preempted
from vllm_actors.protocol.messages import AddRequest, Message, RequestUpdate, RequestUpdates
from vllm_actors.protocol.names import FRONTEND

if TYPE_CHECKING:
    from vllm_actors.actors.scheduler.scheduler import Scheduler


def reset_pipeline(scheduler: Scheduler, reason: str) -> None:
    """The KV-cache manager or a worker was restarted: what the pipeline held is gone."""
    running, scheduler.running = scheduler.running, []
    for request in running:  # PREEMPTED in batch order; the queue keeps that order
        scheduler._events.append(
            Preempted(
                request_id=request.request_id,
                step_id=scheduler._next_step_id,
                num_computed_tokens=request.num_computed_tokens,
            )
        )
        request.status = Status.WAITING
        request.num_preemptions += 1
    scheduler.waiting.extendleft(reversed(running))
    scheduler.stats.num_preemptions += len(running)
    for request in scheduler.requests.values():  # waiting ones too: their tokens in flight are lost
        request.num_computed_tokens = 0
        request.num_pending = 0
        request.in_worker = False
        request.cache_check_at = 0
    config = scheduler.config
    scheduler.ledger = BlockLedger(config.num_blocks, config.block_size, config.enable_prefix_caching)
    scheduler._departed = []
    scheduler._in_flight.clear()
    scheduler._reset_pending = True
    scheduler._reset_step = None
    scheduler.stats.num_resets += 1
    scheduler._events.append(PipelineReset(reason=reason, num_preempted=len(running)))


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
