"""A scheduler driven directly by hand-made messages, and readers of what it sends: shared by the
tests of its recovery (resets, resubmissions) and of its steps in flight."""

from __future__ import annotations

from typing import Any

from tests.support.outputs import pairs
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import Aborted, Finished, Queued, Resumed
from vllm_actors.protocol.messages import AddRequest, RequestUpdates, StepPlan, StepResult
from vllm_actors.protocol.names import FRONTEND
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams


def scheduler(num_blocks: int = 100, **overrides: Any) -> Scheduler:
    config = dict(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True,
                  block_size=4, num_blocks=num_blocks, max_steps_in_flight=2)
    return Scheduler(SchedulerConfig(**{**config, **overrides}))  # type: ignore[arg-type]


def add(request_id: str, prompt: list[int], outputs: list[int] | None = None, resume: bool = False,
        **params: Any) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=prompt, eos_token_ids=[0],
                      params=SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params}),
                      resume=resume or outputs is not None, output_token_ids=outputs or [])


def plans_of(out: Outputs) -> list[StepPlan]:
    return [message for _, message in pairs(out) if isinstance(message, StepPlan)]


def updates_of(out: Outputs) -> list[Any]:
    return [u for destination, m in pairs(out) if destination == FRONTEND and isinstance(m, RequestUpdates)
            for u in m.updates]


def events_of(out: Outputs | list[tuple[str, Any]], kind: type) -> list[Any]:
    return [message for _, message in pairs(out) if isinstance(message, kind)]


def ignored(out: Outputs) -> bool:
    """Nothing for the client and no request event: the message changed nothing (the scheduler
    may still send its next plan, a step being back in flight)."""
    return not updates_of(out) and not any(isinstance(m, (Queued, Aborted, Resumed, Finished)) for _, m in pairs(out))


def result_of(plan: StepPlan, token: int = 5) -> StepResult:
    """What a worker returns for a plan whose requests all sample."""
    return StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=list(plan.req_ids),
                      token_ids=[token] * len(plan.req_ids))

