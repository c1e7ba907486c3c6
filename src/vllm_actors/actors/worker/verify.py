"""Speculative decoding in the worker: a drafting request's ``1 + d`` sampler rows, and the tokens
it keeps.

Verification draws the target model's token at every position (the last known token's and each
draft's) with the sampler as it is, a row per position keyed by its own output index, and keeps
the drafts up to the first one the target's draw disagrees with, plus the target's draw there (or
after the last draft). Each kept token is the target's own draw given the tokens before it, so the
output is exactly what decoding without speculation draws: the same tokens for greedy rows and for
seeded rows (their noise is keyed by (seed, output index)), the same distribution for unseeded
ones (fresh noise per row). For a deterministic drafter (n-gram) this accepts a draft with the
target's probability of it, as rejection sampling would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the types only: this module runs without torch
    from vllm_actors.actors.worker.step_data import SamplingRow, WorkerRequest
    from vllm_actors.protocol.messages import Logprobs


@dataclass
class SpecStats:
    """A step's drafting, for its STEP_FINISHED event."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


def expand_rows(samplers: list[WorkerRequest],
                drafts: list[list[int]]) -> tuple[list[SamplingRow], list[WorkerRequest]]:
    """One sampler row per verified position (output index counting on, the drafts before it its
    ``drafted``), and the request of each."""
    rows: list[SamplingRow] = []
    owners: list[WorkerRequest] = []
    for request, drafted in zip(samplers, drafts, strict=True):
        row = request.sampling_row()
        rows.append(row)
        owners.append(request)
        make = type(row)  # SamplingRow: its fields in order (dataclasses.replace costs more per row)
        for position in range(1, len(drafted) + 1):
            rows.append(make(row.params, row.num_output_tokens + position, row.min_tokens_stop_ids,
                             row.token_ids, row.num_prompt_tokens, row.penalty_slot, drafted[:position]))
            owners.append(request)
    return rows, owners


def verify(samplers: list[WorkerRequest], drafts: list[list[int]], chosen: list[int],
           logprobs: list[Logprobs | None]) -> tuple[list[WorkerRequest], list[int], list[Logprobs | None], SpecStats]:
    """The tokens each request keeps (one entry per token, its request repeated), their logprobs,
    and the step's counts; each drafting request's computed tokens rolled back by its rejected
    drafts (their KV slots are rewritten by later steps)."""
    kept_by: list[WorkerRequest] = []
    kept: list[int] = []
    kept_logprobs: list[Logprobs | None] = []
    stats = SpecStats(accepted_per_pos=[0] * max((len(d) for d in drafts), default=0))
    row = 0
    for request, drafted in zip(samplers, drafts, strict=True):
        accepted = 0
        while accepted < len(drafted) and chosen[row + accepted] == drafted[accepted]:
            accepted += 1
        count = accepted + 1
        kept_by.extend([request] * count)
        kept.extend(chosen[row : row + count])
        if logprobs:
            kept_logprobs.extend(logprobs[row : row + count])
        if drafted:
            request.num_computed_tokens -= len(drafted) - accepted
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafted)
            stats.num_accepted_tokens += accepted
            for position in range(accepted):
                stats.accepted_per_pos[position] += 1
        row += len(drafted) + 1
    return kept_by, kept, kept_logprobs, stats
