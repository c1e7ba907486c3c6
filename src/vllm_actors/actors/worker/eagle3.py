"""EAGLE-3 drafts, proposed in the worker just before the target verifies them (as a draft model's:
the plan's ``WORKER_DRAFT`` placeholders filled in; ``draft_model.py`` says how they are planned).

The head at position ``p`` reads the token at ``p + 1`` and the target's fused hidden state at
``p`` (stored at the slot of ``p`` by the target's forward pass, ``models/eagle3.py``), and its
output there predicts the token at ``p + 2``. A request of ``n`` known tokens (the target has
computed the first ``n - 1``) is proposed for in:

1. a catch-up pass over positions ``valid .. n - 2`` (the whole prompt the first time; in passes
   of at most ``max_num_tokens`` tokens), whose last row gives the first draft;
2. one pass per further draft at the next position, its input the previous draft and its hidden
   state the previous pass's pre-norm output (vLLM's proposer), batched over the requests, with no
   host sync between passes.

``valid`` is where the head's KV stops holding the target's states: ``n - 1`` after a proposal, as
the later passes wrote it from the head's own states; the next catch-up rewrites from there.
Exactness does not depend on the drafts: verification keeps a draft iff the target's draw equals it.
A request seen again (re-admitted, a prefix-cache hit) starts over from 0: the fused states of
cached blocks are the target's for the same tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from vllm_actors.actors.worker.draft_model import read_passes
from vllm_actors.actors.worker.draft_slots import DraftWork, drafting_work, with_drafts
from vllm_actors.actors.worker.step_data import BatchInput, WorkerRequest
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.protocol.messages import StepPlan


class HeadEngine(Protocol):
    """The head's runner (``runner.eagle3.Eagle3Runner``)."""

    @property
    def max_num_tokens(self) -> int: ...

    def execute(self, batch: BatchInput, ids: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft ids, pre-norm outputs) of ``batch.logits_indices``."""
        ...


class Eagle3Proposer:
    def __init__(self, runner: HeadEngine) -> None:
        self.runner = runner
        self._valid: dict[str, int] = {}

    def forget(self, request_id: str) -> None:
        self._valid.pop(request_id, None)

    def clear(self) -> None:
        self._valid.clear()

    def propose(self, plan: StepPlan, requests: Mapping[str, WorkerRequest]) -> StepPlan:
        """The plan with its ``WORKER_DRAFT`` placeholders replaced by the head's tokens."""
        work = drafting_work(plan, requests)
        if not work:
            return plan
        proposals = self._draft(work)
        for item in work:
            self._valid[item.request.request_id] = item.length - 1
        return with_drafts(plan, work, proposals)

    def _draft(self, work: list[DraftWork]) -> list[list[int]]:
        ids, hidden = self._catch_up(work)
        passes: list[tuple[list[int], torch.Tensor]] = [(list(range(len(work))), ids)]
        for step in range(1, max(item.num_drafts for item in work)):
            previous_rows, previous = passes[-1]
            row_of = {index: row for row, index in enumerate(previous_rows)}
            active = [index for index in previous_rows if work[index].num_drafts > step]
            rows = upload([row_of[index] for index in active], previous.device)
            batch = BatchInput(
                token_ids=[],  # the previous drafts, on the device
                positions=[work[index].length - 2 + step for index in active],
                query_lens=[1] * len(active),
                seq_lens=[work[index].length - 1 + step for index in active],
                block_tables=[work[index].table for index in active],
                logits_indices=list(range(len(active))),
            )
            ids, hidden = self.runner.execute(batch, previous.index_select(0, rows), hidden.index_select(0, rows))
            passes.append((active, ids))
        return read_passes(passes, len(work))

    def _catch_up(self, work: list[DraftWork]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's KV written from the target's states up to each request's position ``n - 2``;
        the first drafts and their pre-norm outputs, one row per request, on the device."""
        cursor = [min(self._valid.get(item.request.request_id, 0), item.length - 2) for item in work]
        firsts: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(work)
        while any(start < item.length - 1 for start, item in zip(cursor, work, strict=True)):
            batch = BatchInput([], [], [], [], [], [])
            budget = self.runner.max_num_tokens
            finishing: list[int] = []
            for index, item in enumerate(work):
                start = cursor[index]
                count = min(item.length - 1 - start, budget)
                if count <= 0:
                    continue
                batch.token_ids.extend(item.request.token_ids[start + 1 : start + 1 + count])  # the next tokens
                batch.positions.extend(range(start, start + count))
                batch.query_lens.append(count)
                batch.seq_lens.append(start + count)
                batch.block_tables.append(item.table)
                cursor[index] += count
                budget -= count
                if cursor[index] == item.length - 1:
                    finishing.append(index)
                    batch.logits_indices.append(len(batch.token_ids) - 1)
            ids, hidden = self.runner.execute(batch)
            for row, index in enumerate(finishing):
                firsts[index] = (ids[row : row + 1], hidden[row : row + 1])
        done = [first for first in firsts if first is not None]
        return torch.cat([ids for ids, _ in done]), torch.cat([hidden for _, hidden in done])
