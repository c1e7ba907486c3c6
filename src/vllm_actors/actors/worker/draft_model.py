"""A draft model's drafts, proposed in the worker just before the target verifies them.

The scheduler plans a drafting request as it does for n-gram drafts, its drafts ``WORKER_DRAFT``
placeholders (how many it may take, from the drafts-per-step policy); here they are filled in with
the draft model's greedy tokens, then the step runs and verifies them as any drafts (``verify``).
Exactness does not depend on the drafts: a draft is kept iff the target's own draw equals it.

The draft model's KV lives in its own tensors under the request's block ids. Per request this keeps
how many leading tokens have their draft KV written (``valid``) and the drafts written after them
(right or not: the next proposal keeps those the request's tokens confirm). A proposal runs:

1. a catch-up pass over each drafting request's tokens from ``valid`` to its last token (its whole
   prompt the first time; in passes of at most ``max_num_tokens`` tokens), whose last logits give
   the first draft (in the steady state a couple of tokens a request: replayed as decode rows);
2. one decode-shaped pass per further draft, batched over the requests that still draft, each
   pass's input ids taken on the device from the previous pass's argmax (no host sync between).

A request speculates only when its previous step is read back (the scheduler holds it to one step
in flight), so every token it has is on the host. A request re-admitted (preempted, resumed, a hit
in the prefix cache) starts over from 0: a block's draft KV is only trusted where this worker wrote
it for this request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import takewhile
from typing import Protocol

import torch

from vllm_actors.actors.worker.draft_slots import DraftWork, drafting_work, with_drafts
from vllm_actors.actors.worker.ranks import Ranks, SingleRank
from vllm_actors.actors.worker.step_data import BatchInput, DeferredInputs, WorkerRequest
from vllm_actors.actors.worker.uploads import upload
from vllm_actors.protocol.messages import StepPlan

# A catch-up of at most this many tokens a request asks the logits of every token: the step is then
# verification-shaped, and the draft's decode graphs run it as one decode row per token
# (runner/verify_rows.py's MAX_QUERY_LEN) instead of an eager pass whose launches the device waits on.
SHORT_CATCH_UP = 8


class DraftEngine(Protocol):
    """The draft model's runner (``runner.draft_model.DraftRunner``)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def max_num_tokens(self) -> int: ...

    def execute(self, batch: BatchInput) -> torch.Tensor:
        """The logits of ``batch.logits_indices``, one row each."""
        ...


@dataclass
class _DraftKv:
    valid: int = 0  # leading tokens whose draft KV holds the request's own tokens
    written: list[int] = field(default_factory=list)  # drafts whose KV follows them, maybe rejected


def read_passes(passes: list[tuple[list[int], torch.Tensor]], num_requests: int) -> list[list[int]]:
    """Each request's drafts from the passes (their rows' request indices, their ids on the device):
    the one wait on the device."""
    host = torch.cat([chosen for _, chosen in passes]).tolist()
    proposals: list[list[int]] = [[] for _ in range(num_requests)]
    offset = 0
    for rows, _ in passes:
        for row, index in enumerate(rows):
            proposals[index].append(host[offset + row])
        offset += len(rows)
    return proposals


class DraftProposer:
    def __init__(self, runner: DraftEngine, ranks: Ranks | None = None) -> None:
        self.runner = runner
        self.ranks = ranks or SingleRank()  # tensor parallelism: every rank drafts, rank 0's drafts are kept
        self._kv: dict[str, _DraftKv] = {}
        self._fences: list[torch.cuda.Event] = []

    def forget(self, request_id: str) -> None:
        self._kv.pop(request_id, None)

    def clear(self) -> None:
        self._kv.clear()

    def propose(self, plan: StepPlan, requests: Mapping[str, WorkerRequest]) -> StepPlan:
        """The plan with its ``WORKER_DRAFT`` placeholders replaced by the draft model's tokens."""
        work = drafting_work(plan, requests)
        if not work:
            return plan
        proposals = self._draft(work)
        for item, drafted in zip(work, proposals, strict=True):  # this rank's drafts: its draft KV's
            self._kv[item.request.request_id] = _DraftKv(item.length, drafted[:-1])
        if self.ranks.enabled:
            proposals = self._rank0s(work, proposals)
        return with_drafts(plan, work, proposals)

    def _rank0s(self, work: list[DraftWork], proposals: list[list[int]]) -> list[list[int]]:
        """Rank 0's proposals on every rank (one broadcast of every placeholder, -1 past a proposal's
        end), so that every rank verifies the same drafts however its own draft's rounding went."""
        flat: list[int] = []
        for item, drafted in zip(work, proposals, strict=True):
            flat += drafted + [-1] * (item.num_drafts - len(drafted))
        ids = self.ranks.broadcast(upload(flat, self.runner.device, torch.long)).tolist()
        found: list[list[int]] = []
        offset = 0
        for item in work:
            found.append(list(takewhile(lambda token: token >= 0, ids[offset : offset + item.num_drafts])))
            offset += item.num_drafts
        return found

    def _draft(self, work: list[DraftWork]) -> list[list[int]]:
        self._fences.clear()
        firsts = self._catch_up(work)
        passes: list[tuple[list[int], torch.Tensor]] = [(list(range(len(work))), firsts)]
        for position in range(1, max(item.num_drafts for item in work)):
            previous_rows, previous = passes[-1]
            row_of = {index: row for row, index in enumerate(previous_rows)}
            active = [index for index in previous_rows if work[index].num_drafts > position]
            batch = BatchInput(
                token_ids=[0] * len(active),  # filled on the device from the previous pass's tokens
                positions=[work[index].length - 1 + position for index in active],
                query_lens=[1] * len(active),
                seq_lens=[work[index].length + position for index in active],
                block_tables=[work[index].table for index in active],
                logits_indices=list(range(len(active))),
                deferred=DeferredInputs(list(range(len(active))), previous, [row_of[index] for index in active]),
            )
            passes.append((active, self._run(batch)))
        return read_passes(passes, len(work))

    def _catch_up(self, work: list[DraftWork]) -> torch.Tensor:
        """Each request's draft KV brought up to its last token (confirmed drafts kept); the draft
        model's greedy token after it, per request, on the device."""
        cursor = []
        for item in work:
            kv = self._kv.get(item.request.request_id, _DraftKv())
            confirmed = 0
            tokens = item.request.token_ids
            while (confirmed < len(kv.written) and kv.valid + confirmed < item.length - 1
                   and tokens[kv.valid + confirmed] == kv.written[confirmed]):
                confirmed += 1
            cursor.append(min(kv.valid + confirmed, item.length - 1))
        firsts: list[torch.Tensor | None] = [None] * len(work)
        while any(start < item.length for start, item in zip(cursor, work, strict=True)):
            left = [item.length - start for start, item in zip(cursor, work, strict=True)]
            every_row = max(left) <= SHORT_CATCH_UP and sum(left) <= self.runner.max_num_tokens
            batch = BatchInput([], [], [], [], [], [])
            budget = self.runner.max_num_tokens
            finishing: list[tuple[int, int]] = []  # (request index, its logits row)
            for index, item in enumerate(work):
                start = cursor[index]
                count = min(item.length - start, budget)
                if count <= 0:
                    continue
                batch.token_ids.extend(item.request.token_ids[start : start + count])
                batch.positions.extend(range(start, start + count))
                batch.query_lens.append(count)
                batch.seq_lens.append(start + count)
                batch.block_tables.append(item.table)
                cursor[index] += count
                budget -= count
                if cursor[index] == item.length:
                    last = len(batch.token_ids) - 1
                    finishing.append((index, last if every_row else len(batch.logits_indices)))
                    if not every_row:
                        batch.logits_indices.append(last)
            if every_row:  # verification-shaped: the draft's decode graphs serve it (runner/verify_rows.py)
                batch.logits_indices.extend(range(len(batch.token_ids)))
            chosen = self._run(batch)
            for index, row in finishing:
                firsts[index] = chosen[row : row + 1]
        return torch.cat([first for first in firsts if first is not None])

    def _run(self, batch: BatchInput) -> torch.Tensor:
        """One draft pass: its greedy tokens on the device. On a GPU a pass's host buffers are
        reused two passes later: the pass before the last must be done before they are refilled."""
        if len(self._fences) >= 2:
            self._fences[-2].synchronize()
        chosen = self.runner.execute(batch).argmax(dim=-1)
        if self.runner.device.type == "cuda":
            fence = torch.cuda.Event()
            fence.record()
            self._fences.append(fence)
        return chosen
