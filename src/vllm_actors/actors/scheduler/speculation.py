"""Speculative decoding as the scheduler plans it (``spec_policy``; the benchmarks' ``oracle``
drafts here; n-gram, a draft model's and an EAGLE-3 head's drafts are proposed by the worker: the
plan holds ``WORKER_DRAFT`` per token it may draft).

The plan gives a drafting request ``1 + d`` tokens (its last sampled token and ``d`` drafts,
``StepPlan.draft_token_ids``) and the KV blocks they need; the worker verifies all of them in one
forward pass and returns the tokens it accepted plus one (``StepResult`` repeats the request's id
per token). Here the request's computed count is rolled back by the rejected drafts and blocks
beyond its slots are given back (``StepPlan.trimmed_blocks``). The worker's n-gram lookup may find
fewer drafts than planned (``StepResult.num_drafted``): the slots past them are rolled back as
rejected, and only the drafts it verified count as drafted. How many its lookups find is measured
too (``Acceptance.reach``): a request whose lookups find one draft of the 4 planned, right 87% of
the time, gains 1.9 tokens a step, not the 3.9 its acceptance alone would say.

Steps in flight: an n-gram request keeps two. Its next step is planned as if every draft of the
one in flight were accepted (``num_pending_drafts``): its computed count is then the furthest slot
the next step may write, its blocks cover it, and the rollback by the rejected drafts when the
result comes back composes; the worker drafts from the tokens it has by then. A request drafted
for by the oracle, a draft model or a head runs one step in flight: planned again once its
previous step's result is back.

Every request may speculate: a verification row sees the drafts before it as output (its
penalties, bad words and grammar mask follow them), and the worker cuts a constrained request's
drafts before the first its grammar refuses; such requests verify with their step read back at
once (their kept tokens counted and fed from the host). Its drafts per step come from
``spec_policy`` (one plan per pass: the step cost model, the measured extra cost of drafting steps
and the requests' acceptances), or are always the configured number with ``adaptive`` off. While
the plan says 0 a request decodes with two steps in flight, and probes now and then
(``spec_probes``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.scheduler.cost_model import CostModel, StepFeatures
from vllm_actors.actors.scheduler.deadlines import step_features
from vllm_actors.actors.scheduler.oracle import OracleDrafter
from vllm_actors.actors.scheduler.prefill_sizing import is_decoding
from vllm_actors.actors.scheduler.request import ScheduledRequest, Status
from vllm_actors.actors.scheduler.spec_policy import NO_DRAFTS, Acceptance, DraftCost, choose_drafts
from vllm_actors.actors.scheduler.spec_probes import PROBE_INTERVAL, Pace, choose_probers
from vllm_actors.actors.scheduler.spec_wall import WallPolicy, step_seconds
from vllm_actors.protocol.messages import StepPlan, StepResult
from vllm_actors.protocol.ngram import propose_ngram
from vllm_actors.protocol.speculative import ORACLE, WORKER_DRAFT, WORKER_METHODS, SpeculativeConfig
from vllm_actors.protocol.token_ids import pack_token_ids

NGRAM = "ngram"


@dataclass
class SpecCounters:
    """Totals since start (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # request-steps that drafted at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


WARMUP_STEPS = 4  # plain steps the step cost model learns from before anything is drafted
REFRESH_STEPS = 128  # drafting steps in a row after which a pass drafts nothing (a plain step measured)
REVIEW_PASSES = 16  # a quiet plan (no drafts, no probe) holds this many passes at most, the batch unchanged


class Speculator:
    def __init__(self, config: SpeculativeConfig, cost: CostModel, block_size: int = 16,
                 overlapped: bool = True) -> None:
        """``cost``: the scheduler's step cost model (plain steps); ``overlapped``: two steps in flight."""
        self.config = config
        self.cost = cost
        self.block_size = block_size
        self.overlapped = overlapped
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.recent = Acceptance()  # every request's verifications: a new request's starting acceptance
        self.draft_cost = DraftCost()  # what drafting adds, in execute_seconds (drafts not made in the worker)
        self._paces: dict[str, Pace] = {}
        self._trims: dict[str, int] = {}  # request id -> blocks it keeps (the next plan's trimmed_blocks)
        self.oracle = OracleDrafter(config) if config.method == ORACLE else None  # benchmarks only
        self.two_in_flight = overlapped and config.method == NGRAM  # a drafting request keeps two steps in flight
        # n-gram drafts in the worker: priced in wall time per batch size (spec_wall)
        self.wall = WallPolicy(cost) if self.two_in_flight else None
        self._plan = NO_DRAFTS  # this pass's
        self._probers: set[str] = set()  # this pass's (spec_probes)
        self._quiet = False  # this pass drafts for nobody (no plan, no probe): a request's idle step only
        self._passes = 0  # planning passes
        self._quiet_passes = 0  # quiet ones: each request's idle step, counted once for all (Pace.mark)
        self._review_at = 0  # the pass from which a quiet plan is chosen again
        self._quiet_key: tuple[int, int] = (-1, -1)  # (running requests, _version) when it was chosen
        self._version = 0  # bumped when an acceptance the plan reads changes (a pace made, verified, forgotten)
        self._seconds_since_draft = 0.0  # measured seconds of the steps since the last drafting one
        self._plain_steps = 0  # steps without drafts the step cost model learnt from
        self._drafting_run = 0  # drafting steps since the last step without drafts

    @property
    def quiet(self) -> bool:
        """This pass drafts for nobody (no plan, no probe): ``drafts`` is [] for every request, so
        the planning pass need not ask per request (its idle steps are counted once, in ``_pace``)."""
        return self._quiet

    @property
    def has_trims(self) -> bool:
        """Blocks given back in the ledger that the next plan gives back in the KV manager."""
        return bool(self._trims)

    def begin_pass(self, running: list[ScheduledRequest]) -> None:
        """The pass's plan (``spec_policy.choose_drafts``) over the decoding requests, and whether
        it probes: nothing is drafted before the step cost model has seen ``WARMUP_STEPS`` plain
        steps, nor after ``REFRESH_STEPS`` drafting steps in a row (a plain one refreshes it).
        A quiet plan (no drafts, no probe) holds without a look at the requests while the batch and
        their acceptances are unchanged, for ``REVIEW_PASSES`` at most and until a probe may be due:
        such a pass costs O(1), not O(batch)."""
        self._passes += 1
        if self._quiet and self._passes < self._review_at and self._quiet_key == (len(running), self._version):
            self._quiet_passes += 1
            return
        self._plan, self._probers, self._quiet = NO_DRAFTS, set(), self.config.adaptive
        if not self.config.adaptive or self._plain_steps < WARMUP_STEPS or self._drafting_run >= REFRESH_STEPS:
            self._quiet_passes += self._quiet
            self._review_at = 0
            if self.wall is not None:
                self.wall.plain_pass()
            return
        decoding = [request for request in running if is_decoding(request)]
        candidates = [(request, self._pace(request.request_id)) for request in decoding
                      if request.output_token_ids]
        if self.wall is not None:
            self._plan, self._probers = self.wall.choose(candidates, len(decoding), self.config.num_speculative_tokens,
                                                         self._seconds_since_draft)
        else:
            self._plan = choose_drafts([pace.acceptance.bucket for _, pace in candidates], len(decoding),
                                       self.config.num_speculative_tokens, self.cost, self.draft_cost, self.overlapped)
            self._probers = choose_probers(candidates, self.draft_cost, self._seconds_since_draft)
        self._quiet = not self._plan.num_drafts and not self._probers
        if self._quiet:
            self._quiet_passes += 1
            longest = max((pace.idle for _, pace in candidates), default=0)  # the first to probe
            wait = PROBE_INTERVAL - longest if longest < PROBE_INTERVAL else REVIEW_PASSES  # due: costs too much now
            if self.wall is not None and self.wall.measuring:  # it may draft once a few plain steps are measured
                wait = 1
            self._review_at = self._passes + max(1, min(REVIEW_PASSES, wait))
            self._quiet_key = (len(running), self._version)

    def _pace(self, request_id: str) -> Pace:
        """A request's pace, its idle steps of the quiet passes since it was last read added."""
        pace = self._paces.get(request_id)
        if pace is None:
            pace = self._paces[request_id] = Pace(Acceptance.starting_at(self.recent), mark=self._quiet_passes)
            self._version += 1
        elif pace.mark != self._quiet_passes:
            pace.idle += self._quiet_passes - pace.mark
            pace.mark = self._quiet_passes
        return pace

    def _max_drafts(self, request_id: str) -> tuple[int, Pace | None]:
        """The pass's drafts for a request: the plan's, or one for a probe."""
        if not self.config.adaptive:
            return self.config.num_speculative_tokens, None
        pace = self._pace(request_id)
        max_drafts = self._plan.drafts_for(pace.acceptance)
        if not max_drafts and request_id in self._probers:
            max_drafts = 1
        return max_drafts, pace

    def drafts(self, request: ScheduledRequest, budget: int, max_model_len: int) -> list[int] | None:
        """The drafts of a decoding request this step ([]: plain decode); None: it waits for its
        step in flight (it speculates, and drafts need its last token, unless the worker drafts
        with two steps in flight: the room is then that of every pending draft accepted)."""
        if self._quiet:  # what the plan gives every request this pass: 0 drafts (its idle step: _quiet_passes)
            return []
        if not request.output_token_ids:
            return []
        max_drafts, pace = self._max_drafts(request.request_id)
        if max_drafts == 0:
            if pace is not None:
                pace.idle += 1
            return []
        if request.num_pending and not self.two_in_flight:
            return None
        room = [max_drafts, budget - 1, max_model_len - request.num_tokens_with_pending - 1]
        if request.params.max_tokens is not None:
            outputs = len(request.output_token_ids) + request.num_pending + request.num_pending_drafts
            room.append(request.params.max_tokens - outputs - 1)
        num_drafts = min(room)
        if num_drafts < 1:
            return []
        if pace is not None:
            pace.drafting(request.num_tokens)
        if self.config.method in WORKER_METHODS or self.two_in_flight:  # the worker proposes them
            return [WORKER_DRAFT] * num_drafts
        if self.oracle is not None:
            found = self.oracle.propose(request, num_drafts)
        else:  # n-gram with one step in flight (the scheduler's steps are not overlapped)
            packed = request.packed_prompt + pack_token_ids(request.output_token_ids)
            found = propose_ngram(packed, num_drafts, self.config.prompt_lookup_min, self.config.prompt_lookup_max)
        if not found and pace is not None:
            pace.acceptance.observe(1, 0)  # a step held to one in flight for nothing: a wrong draft
        return found

    def account(self, plan: StepPlan, result: StepResult, requests: dict[str, ScheduledRequest],
                features: StepFeatures | None = None) -> None:
        """Before the result's tokens are applied: each drafting request's acceptance counted and
        its computed tokens rolled back by its rejected drafts; a step's time teaches the pricing
        (``wall``, or ``draft_cost`` what a drafting step cost beyond the step cost model's plain step).
        ``features``: the plan's ``step_features`` where the caller has them."""
        if features is None:
            features = step_features(plan, self.block_size)
        drafted = {request_id: result.num_drafted.get(request_id, len(drafts))
                   for request_id, drafts in plan.draft_token_ids.items()}
        sizes = list(drafted.values())
        # placeholders the worker dropped because the verification before was in flight: a plain row
        overlapped = set(result.overlapped_ids)
        if self.wall is not None:
            self.wall.account(features, any(request_id not in overlapped for request_id in drafted), sizes,
                              step_seconds(result))
        if not any(sizes):  # a plain step (or one the worker drafted nothing for: it ran deferred)
            self._seconds_since_draft += step_seconds(result) if self.wall is not None else result.execute_seconds
            if result.execute_seconds > 0 and 1 in plan.num_tokens:
                self._plain_steps += 1
                self._drafting_run = 0
            if not plan.draft_token_ids:
                return
        else:
            self._drafting_run += 1
            self._seconds_since_draft = 0.0
            if self.wall is None and result.execute_seconds > 0:  # priced in execute_seconds
                prefill_tokens, num_decodes, pairs, scan = features
                catch_up = sum(pace.catch_up for pace in map(self._paces.get, plan.draft_token_ids)
                               if pace is not None)  # only this pricing reads it (n-gram's wall has none)
                extra = result.execute_seconds - self.cost.step_seconds(prefill_tokens, num_decodes, pairs, scan)
                self.draft_cost.observe(max(sizes), sum(sizes), catch_up, extra)
        emitted = Counter(result.req_ids)
        counters, paces, recent = self.counters, self._paces, self.recent
        running = Status.RUNNING
        for request_id, drafts in plan.draft_token_ids.items():
            num_drafted = drafted[request_id]  # the planned slots past it are rolled back as rejected
            pace = paces.get(request_id)
            if not num_drafted:  # the lookup found nothing: no counter moves, one wrong draft observed
                if pace is not None and request_id not in overlapped:
                    self._version += 1
                    pace.verified(1, 0)
                    recent.observe(1, 0)
                request = requests.get(request_id)
                if request is not None:
                    request.num_pending_drafts -= len(drafts)
                    if request.status is running and request.in_worker:
                        request.num_computed_tokens -= len(drafts)
                continue
            num_accepted = min(max(emitted.get(request_id, 0) - 1, 0), num_drafted)
            counters.num_drafts += 1
            counters.num_draft_tokens += num_drafted
            counters.num_accepted_tokens += num_accepted
            for position in range(num_accepted):
                counters.accepted_per_pos[position] += 1
            if pace is not None:
                self._version += 1
                pace.verified(num_drafted, num_accepted, len(drafts))
                recent.observe(num_drafted, num_accepted)
            request = requests.get(request_id)
            if request is None:
                continue
            request.num_pending_drafts -= len(drafts)
            request.num_draft_tokens += num_drafted
            request.num_accepted_tokens += num_accepted
            if request.status is running and request.in_worker:
                request.num_computed_tokens -= len(drafts) - num_accepted

    def trim(self, plan: StepPlan, requests: dict[str, ScheduledRequest], ledger: BlockLedger) -> None:
        """After the result: a drafting request still running gives back the blocks beyond its
        tokens and its computed count (the furthest slot of a step in flight): they held rejected
        drafts only; the next plan tells the KV manager and workers."""
        block_size, running = ledger.block_size, Status.RUNNING
        for request_id in plan.draft_token_ids:
            request = requests.get(request_id)
            if request is None or request.status is not running or not request.in_worker:
                continue
            keep = -(-max(request.num_tokens, request.num_computed_tokens) // block_size)
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
        self._version += 1
        self._paces.pop(request.request_id, None)
        self._trims.pop(request.request_id, None)
        if self.oracle is not None:
            self.oracle.learn(request)
