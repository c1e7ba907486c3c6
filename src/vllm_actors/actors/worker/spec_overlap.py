"""A plain step launched before the n-gram verification in flight is read back (issue 41).

A drafting step used to be read back at once: the next step's host work (its lookup, its batch)
then ran while the device idled. Here the verification step ``N`` is launched like a deferred
step (its draws stay on the device, its accepted counts are computed there: ``accepted_counts``),
and when the next plan arrives before ``N`` is read back it runs as a **plain step** launched
first (``plain_over_verification``): every placeholder of it dropped (``StepResult.num_drafted``
0: the scheduler rolls their slots back as it does for a lookup that found nothing), and each
request that drafted ``d`` tokens in ``N`` from position ``p`` a plain decode row built as if all
were accepted (position ``p + d + 1``, its input the draw after the last draft). On the device,
with ``a`` its accepted count, the row moves back to position ``p + a + 1``, its KV slot and
sequence length with it, and its input becomes the target's draw at ``a`` (``OverlapRows``,
applied by the runner: ``runner/deferred_inputs.fix_overlap``). The host's counts compose as the
scheduler's do: the row's computed count is rolled back by ``d - a`` when ``N`` is read back.
The step after drafts again from the tokens read back meanwhile: a request alternates a drafting
step and a plain overlapped one.

Exact only where the row's draw does not depend on its output index, which the host does not
know yet: greedy rows and unseeded ones (keyed by the step and the row). A plan falls back to
reading ``N`` back first (``None``) when a request that drafted in ``N`` is seeded and not greedy,
or may still be under its ``min_tokens`` mask; when the plan has drafts other than placeholders,
prefill tokens (``fix_overlap`` serves decode steps only), a reset, or rows that need the host.
``OverlapSteps._verifies_later`` (``overlap_steps.py``) says which drafting plans are launched so at
all (n-gram drafts in the worker, one rank, one stage, no borrowed KV, no structured outputs, a
runner that fixes rows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from vllm_actors.actors.worker.draft_slots import placeholder_counts, short_drafts, with_found
from vllm_actors.actors.worker.step_data import BatchInput, OverlapRows, PendingStep, WorkerRequest
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.protocol.messages import StepPlan

if TYPE_CHECKING:
    from vllm_actors.actors.worker.engine import TokenSampler


def accepted_counts(chosen: torch.Tensor, drafts: list[list[int]]) -> torch.Tensor:
    """Each sampler's accepted drafts (0 for a plain row), on the device, no host sync: its drafts
    compared with the target's draws at their positions, up to the first mismatch. ``chosen``: the
    step's draws, ``1 + len(drafts[i])`` rows per sampler in order."""
    width = max(len(drafted) for drafted in drafts)
    index: list[int] = []
    wanted: list[int] = []
    for row, drafted in zip(first_rows(drafts), drafts, strict=True):
        index.extend(row + position for position in range(len(drafted)))
        index.extend([row] * (width - len(drafted)))
        wanted.extend(drafted)
        wanted.extend([-1] * (width - len(drafted)))  # never a token: the count stops there
    packed = upload(index + wanted, chosen.device).view(2, len(drafts), width)
    match = chosen.index_select(0, packed[0].reshape(-1)).view(len(drafts), width) == packed[1]
    return match.long().cumprod(dim=1).sum(dim=1)


def first_rows(drafts: list[list[int]]) -> list[int]:
    """Each sampler's first row of the draws (its last known token's)."""
    rows: list[int] = []
    row = 0
    for drafted in drafts:
        rows.append(row)
        row += len(drafted) + 1
    return rows


def plain_over_verification(plan: StepPlan, pending: PendingStep, requests: Mapping[str, WorkerRequest],
                            sampler: TokenSampler) -> tuple[StepPlan, dict[str, int]] | None:
    """``plan`` as a plain step to launch before ``pending`` (a verification not read back) and its
    drafted counts (0 per placeholder dropped); None where it must wait for the read-back (above)."""
    if plan.reset or pending.verifying is None:
        return None
    counts = placeholder_counts(plan)
    if len(counts) != len(plan.draft_token_ids):  # drafts given by the scheduler (the oracle)
        return None
    plain = with_found(plan, counts, {}) if counts else plan
    if any(num_new != 1 for num_new in plain.num_tokens):  # prefill tokens: not a decode step
        return None
    drafted = {request.request_id: len(drafts) for request, drafts in zip(pending.samplers, pending.verifying,
                                                                           strict=True) if drafts}
    for request_id in plain.req_ids:
        request = requests.get(request_id)
        if request is None:
            continue  # a new request (its prompt of one token): an ordinary row
        if sampler.needs_host(request.params):
            return None
        num_drafts = drafted.get(request_id, 0)
        if not num_drafts or request_id in plan.finished_ids:
            continue
        params = request.params
        if params.seed is not None and not params.greedy:  # keyed by its output index, unknown here
            return None
        if request.min_tokens_stop_ids and request.num_output_tokens - num_drafts < params.min_tokens:
            return None  # its min_tokens mask may hold at its true index
    if any(sampler.needs_host(new.params) for new in plan.new_requests):
        return None
    return plain, short_drafts(plan, plain) if counts else {}


def overlap_rows(batch: BatchInput, pending: PendingStep) -> OverlapRows | None:
    """The rows of ``batch`` (a decode step built over ``pending``) that follow a verification:
    those whose deferred input is a drafting sampler's first row of ``pending``'s draws."""
    if batch.deferred is None or pending.verifying is None or pending.accepted is None:
        return None
    starts = first_rows(pending.verifying)
    drafting = {row: index for index, (row, drafts) in enumerate(zip(starts, pending.verifying, strict=True))
                if drafts}
    fix = OverlapRows([], [], [], [], pending.accepted, batch.deferred.source)
    for flat, row in zip(batch.deferred.flat_index, batch.deferred.source_row, strict=True):
        which = drafting.get(row)
        if which is None:
            continue
        fix.rows.append(flat)
        fix.first_row.append(row)
        fix.num_drafts.append(len(pending.verifying[which]))
        fix.which.append(which)
    return fix if fix.rows else None
