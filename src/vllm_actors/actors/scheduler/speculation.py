"""Speculative decoding as the scheduler plans it (n-gram drafts; ``ngram``, ``spec_policy``; the
benchmarks' ``oracle``; a draft model's drafts are proposed by the worker: the plan holds
``WORKER_DRAFT`` per token it may draft).

One step in flight for a speculating request: its drafts are proposed from its known tokens, so a
request that drafts is planned only once the result of its previous step is back (other requests
keep two steps in flight). The plan gives it ``1 + d`` tokens (its last sampled token and ``d``
drafts, ``StepPlan.draft_token_ids``) and the KV blocks they need; the worker verifies all of them
in one forward pass and returns the tokens it accepted plus one (``StepResult`` repeats the
request's id per token). Here the request's computed count is rolled back by the rejected drafts
and blocks holding only rejected slots are given back (``StepPlan.trimmed_blocks``).

A request speculates only where verification is exact and its sampler rows are position-free:
no penalties or other logits controls, no structured outputs. Its drafts per step come from
``spec_policy`` (the step cost model and its own acceptance), or are always the configured number
with ``adaptive`` off. While the policy says 0 the request decodes with two steps in flight and
its acceptance drifts back to the prior, so it is tried again later.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.cost_model import CostModel
from vllm_actors.actors.scheduler.ngram import propose_ngram
from vllm_actors.actors.scheduler.oracle import OracleDrafter
from vllm_actors.actors.scheduler.request import ScheduledRequest, Status
from vllm_actors.actors.scheduler.spec_policy import Acceptance, choose_num_drafts
from vllm_actors.protocol.messages import StepPlan, StepResult, pack_token_ids
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.speculative import ORACLE, WORKER_DRAFT, WORKER_METHODS, SpeculativeConfig


def can_speculate(params: SamplingParams) -> bool:
    """Whether a request's draws can be verified here (see the module's docstring)."""
    return not params.has_controls and params.structured_outputs is None


@dataclass
class SpecCounters:
    """Totals since start (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # request-steps that drafted at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._acceptance: dict[str, Acceptance] = {}
        self._trims: dict[str, int] = {}  # request id -> blocks it keeps (the next plan's trimmed_blocks)
        self._k_memo: dict[tuple[int, int], int] = {}  # (alpha bucket, decodes) -> drafts, this pass
        self.oracle = OracleDrafter(config) if config.method == ORACLE else None  # benchmarks only

    @property
    def has_trims(self) -> bool:
        """Blocks given back in the ledger that the next plan gives back in the KV manager."""
        return bool(self._trims)

    def begin_pass(self) -> None:
        self._k_memo.clear()

    def _max_drafts(self, request_id: str, num_decodes: int) -> int:
        k = self.config.num_speculative_tokens
        if not self.config.adaptive:
            return k
        acceptance = self._acceptance.setdefault(request_id, Acceptance())
        key = (round(acceptance.alpha * 40), num_decodes)
        if key not in self._k_memo:
            self._k_memo[key] = choose_num_drafts(k, key[0] / 40, num_decodes, 0, self.cost)
        return self._k_memo[key]

    def drafts(self, request: ScheduledRequest, budget: int, max_model_len: int, num_decodes: int) -> list[int] | None:
        """The drafts of a decoding request this step ([]: plain decode); None: it waits for its
        step in flight (it speculates, and drafts need its last token)."""
        if not request.output_token_ids or not can_speculate(request.params):
            return []
        max_drafts = self._max_drafts(request.request_id, num_decodes)
        if max_drafts == 0:
            if self.config.adaptive:
                self._acceptance[request.request_id].observe(0, 0)  # drifts back to the prior
            return []
        if request.num_pending:
            return None
        room = [max_drafts, budget - 1, max_model_len - request.num_tokens - 1]
        if request.params.max_tokens is not None:
            room.append(request.params.max_tokens - len(request.output_token_ids) - 1)
        num_drafts = min(room)
        if num_drafts < 1:
            return []
        if self.config.method in WORKER_METHODS:  # the worker's draft model or EAGLE-3 head proposes them
            return [WORKER_DRAFT] * num_drafts
        if self.oracle is not None:
            found = self.oracle.propose(request, num_drafts)
        else:
            packed = request.packed_prompt + pack_token_ids(request.output_token_ids)
            found = propose_ngram(packed, num_drafts, self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        if not found and self.config.adaptive:
            # A step held to one in flight for nothing: counted as num_speculative_tokens rejected
            # drafts, so text without matches stops speculating within a few steps.
            self._acceptance[request.request_id].observe(self.config.num_speculative_tokens, 0)
        return found

    def account(self, plan: StepPlan, result: StepResult, requests: dict[str, ScheduledRequest]) -> None:
        """Before the result's tokens are applied: each drafting request's acceptance counted and
        its computed tokens rolled back by its rejected drafts."""
        if not plan.draft_token_ids:
            return
        emitted = Counter(result.req_ids)
        for request_id, drafts in plan.draft_token_ids.items():
            num_accepted = max(emitted.get(request_id, 0) - 1, 0)
            counters = self.counters
            counters.num_drafts += 1
            counters.num_draft_tokens += len(drafts)
            counters.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                counters.accepted_per_pos[position] += 1
            if request_id in self._acceptance:
                self._acceptance[request_id].observe(len(drafts), num_accepted)
            request = requests.get(request_id)
            if request is None:
                continue
            request.num_draft_tokens += len(drafts)
            request.num_accepted_tokens += num_accepted
            if request.status is Status.RUNNING and request.in_worker:
                request.num_computed_tokens -= len(drafts) - num_accepted

    def trim(self, plan: StepPlan, requests: dict[str, ScheduledRequest], ledger: BlockLedger) -> None:
        """After the result: a drafting request still running gives back the blocks beyond its
        tokens (they held rejected drafts only); the next plan tells the KV manager and workers."""
        for request_id in plan.draft_token_ids:
            request = requests.get(request_id)
            if request is None or request.status is not Status.RUNNING or not request.in_worker:
                continue
            keep = -(-request.num_tokens // ledger.block_size)
            if ledger.num_blocks(request_id) > keep:
                ledger.trim(request_id, keep)
                self._trims[request_id] = keep

    def take_trims(self, departed: list[str]) -> dict[str, int]:
        """The trims since the last plan, less those of requests leaving the worker anyway."""
        trims, self._trims = self._trims, {}
        for request_id in departed:
            trims.pop(request_id, None)
        return trims

    def forget(self, request: ScheduledRequest) -> None:
        """A request finished."""
        self._acceptance.pop(request.request_id, None)
        self._trims.pop(request.request_id, None)
        if self.oracle is not None:
            self.oracle.learn(request)
