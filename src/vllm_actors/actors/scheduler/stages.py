"""Pipeline stages as the scheduler sees them (``pipeline_parallel_size`` above 1).

The steps in flight are the pipeline's micro-batches (``max_steps_in_flight``: at least one per
stage): each stage works on a different step. Only the last stage samples, so a request's next
step that needs its last sampled token is planned once that token is back (its decodes never
overlap themselves), and the plan carries it to the stages before the last (``input_token_ids``).
A prefill chunk samples nothing: the next chunk of the same prompt is planned at once and enters
the first stage right behind it (sequence pipeline parallelism), each chunk attending to the KV its
predecessors left on every stage.

The decoding requests go in one micro-batch per stage, each an equal share (``decode_share``); a
step that would decode while as many decoding steps are in flight as there are stages waits for one
to come back, its requests then joined by the others ready. Without that, the groups that prefilled
together would decode apart for good, as many micro-batches as steps in flight: each decode
micro-batch reads the stage's weights once, and a stage's decode is bound by those reads (Qwen3-8B on
an H200, three micro-batches of 42 sequences: 2 of a step's 3.6 ms). The step in flight beyond the
stages' carries prefills.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from vllm_actors.actors.scheduler.prefill_sizing import is_decoding
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.protocol.messages import StepPlan


def waits_for_its_token(request: ScheduledRequest, pipeline_parallel_size: int) -> bool:
    """Whether the request's next step waits for the token a step in flight samples for it."""
    return pipeline_parallel_size > 1 and request.num_pending > 0


def carry_input_tokens(plan: StepPlan, scheduled: Iterable[ScheduledRequest]) -> None:
    """Give ``plan`` each scheduled request's last sampled token (the stages keep what they hold:
    a stage appends it only where it is the step's input)."""
    new = {request.request_id for request in plan.new_requests}
    plan.input_token_ids = {request.request_id: request.output_token_ids[-1] for request in scheduled
                            if request.output_token_ids and request.request_id not in new}


def decode_share(running: Iterable[ScheduledRequest], num_micro_batches: int) -> int:
    """The most decoding requests one micro-batch takes: an equal share of every decoding request
    (those whose token is in flight too) over ``num_micro_batches`` (the stages)."""
    num_decoding = sum(1 for request in running if is_decoding(request))
    return max(1, math.ceil(num_decoding / max(1, num_micro_batches)))
