"""What steps cost the throughput, per batch size, for the drafts-per-step policy (``spec_policy``).

Measured in wall time (``StepResult.interval_seconds``: from the later of a step's launch and the
previous step's read-back to its own read-back), per bucket of decoding requests (powers of two):

- ``plain``: a plain decode step's interval with two steps in flight, measured only in the plain
  regime: not right after a drafting step (``switch``), nor right before one (its read-back waited for
  the drafting plan and the drain: a cost of drafting too, not what plain decoding runs at);
- ``draft``: what a drafting step adds to it (``DraftCost``, ``e + p k + t n + u c``), fitted on
  the drafting steps' intervals less ``plain``. A drafting step is read back at once, so it drains
  the pipeline of deferred steps (the step before is read back before it launches) and draws its
  tokens outside the decode graph; a step of several drafting requests may leave the decode graphs
  for the padded varlen path. Per bucket, so that a launch-bound batch-1 step's costs are not
  extrapolated to a batch of 64 along ``t n``;
- ``switch``: what the first plain step after a drafting step costs beyond ``plain`` (its inputs
  are prepared while the device idles: the overlap the drafting step gave up), charged to drafting.

Drafting pays or not by the ratio of the two regimes' measured intervals, so a bucket drafts only
once it has measured its own plain steps (``MIN_PLAIN``): a batch entering a new bucket runs plain
for a few steps first (once per bucket). The scheduler's step cost model no longer stands in: it
is fitted on execution times (launch to read-back), longest for the plain steps around drafting
runs (2.2-2.5 ms at 4-15 requests on the H200 in session 21, against 0.77 ms overlapped), and it
priced the tail of a closed batch of 64 whose drafting steps took 1.65 ms for about 1.8 tokens a
request. (A smaller bucket's plain step as a stand-in errs against drafting twice over: the
drafting overhead fitted against it stays too large once the bucket has its own.) A bucket not yet
measured starts from the nearest measured bucket's drafting costs. A step whose
overhead is ``OUTLIER`` times the bucket's plain step plus its prediction teaches nothing unless the
next drafting step's is as large: a first use of a step shape may compile or allocate, and one such
outlier must not stop drafting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from vllm_actors.actors.scheduler.cost_model import CostModel, OnlineCostModel, StepFeatures
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.actors.scheduler.spec_policy import (
    BUCKETS,
    MARGIN,
    NO_DRAFTS,
    DraftCost,
    DraftPlan,
    choose_drafts,
    expected_tokens,
)
from vllm_actors.actors.scheduler.spec_probes import PROBE_STREAK, Pace, choose_probers
from vllm_actors.protocol.messages import StepResult

EMA = 0.1  # weight of each new observation in the plain and switch averages
OUTLIER = 8.0  # an overhead this many times (plain + predicted overhead) is an outlier, unless repeated
MIN_PLAIN = 2  # plain steps of the plain regime a bucket must have measured before it drafts
RUN_EMA = 0.1  # weight of each drafting run's length in their mean
PRIOR_VARIANCE = 1e3  # the fixed part's prior uncertainty (the step cost model's)
TOKEN_SCALE = 1024.0  # drafted tokens per unit of the fixed part's prior uncertainty (256 requests x 4 drafts)


def batch_bucket(num_decodes: int) -> int:
    """The bucket of a step of ``num_decodes`` decoding requests: the next power of two."""
    return 1 << max(num_decodes - 1, 0).bit_length()


def step_seconds(result: StepResult) -> float:
    """The step's wall cost (``execute_seconds`` where the worker sent no interval)."""
    return result.interval_seconds if result.interval_seconds > 0 else result.execute_seconds


def fixed_first_cost() -> DraftCost:
    """What drafting adds, ``e + t n`` (n-gram drafts have no drafter passes nor catch-up): a
    recursive least squares whose prior uncertainty on ``t`` is small, so that the steps' overhead
    goes to the fixed part first (where a launch-bound step's and the lost overlap's is) and ``t``
    is learnt from steps of different drafted counts. (An uncertainty alike on both would put a
    step of 256 drafted tokens' overhead almost all on ``t``, and make drafting for a few requests
    of the batch look cheap when the whole batch pays the fixed part.)"""
    cost = DraftCost(OnlineCostModel(prior=(0.0,) * 5, forgetting=0.98))
    cost.model.covariance = np.diag([PRIOR_VARIANCE, PRIOR_VARIANCE / TOKEN_SCALE**2, 0.0, 0.0, 0.0])
    return cost


@dataclass
class BucketCost:
    plain: float = 0.0
    num_plain: int = 0
    draft: DraftCost = field(default_factory=fixed_first_cost)
    num_drafting: int = 0  # drafting steps seen
    last_extra: float = 0.0  # the last drafting step's measured overhead
    switch: float = 0.0

    def observe_plain(self, seconds: float) -> None:
        self.plain = seconds if not self.num_plain else self.plain + EMA * (seconds - self.plain)
        self.num_plain += 1

    def observe_switch(self, seconds: float) -> None:
        if self.num_plain:
            self.switch += EMA * (max(seconds - self.plain, 0.0) - self.switch)


class WallCosts:
    """The per-bucket estimates; ``fallback`` (the scheduler's step cost model) prices a drafting
    step's prefill tokens."""

    def __init__(self, fallback: CostModel) -> None:
        self.fallback = fallback
        self.buckets: dict[int, BucketCost] = {}

    def bucket(self, num_decodes: int) -> BucketCost:
        key = batch_bucket(num_decodes)
        found = self.buckets.get(key)
        if found is None:
            found = self.buckets[key] = BucketCost()
            measured = [b for b, cost in self.buckets.items() if cost.num_drafting]
            if measured:  # drafting's costs start from the nearest measured bucket's
                nearest = self.buckets[min(measured, key=lambda b: abs(b.bit_length() - key.bit_length()))]
                found.draft.model.theta = nearest.draft.model.theta.copy()  # its own uncertainty: the prior's
                found.switch = nearest.switch
        return found

    def ready(self, num_decodes: int) -> bool:
        """Whether the bucket's own plain steps were measured enough to compare drafting with (a
        batch entering a new bucket runs plain until it has: a few steps, once per bucket)."""
        return self.bucket(num_decodes).num_plain >= MIN_PLAIN

    def plain_seconds(self, num_decodes: int) -> float:
        """The bucket's plain step (0: none measured)."""
        return self.bucket(num_decodes).plain

    def observe_plain(self, num_decodes: int, prefill_tokens: int, seconds: float, after_drafting: bool) -> None:
        """A plain step: decode-only ones teach ``plain``, or ``switch`` right after a drafting step."""
        if prefill_tokens or not num_decodes or seconds <= 0:
            return
        cost = self.bucket(num_decodes)
        if after_drafting:
            cost.observe_switch(seconds)
        else:
            cost.observe_plain(seconds)

    def observe_drafting(self, num_decodes: int, prefill_seconds: float, num_draft_tokens: int,
                         seconds: float) -> None:
        """A drafting step's interval; ``prefill_seconds``: what its prefill chunks cost (not drafting)."""
        cost = self.bucket(num_decodes)
        cost.num_drafting += 1
        if seconds <= 0 or not cost.num_plain:  # no plain step of its own to measure the overhead against
            return
        predicted = cost.draft.seconds(0, num_draft_tokens)
        extra = seconds - prefill_seconds - cost.plain
        outlier = extra > OUTLIER * (cost.plain + predicted) and extra > 2 * cost.last_extra
        cost.last_extra = extra
        if not outlier:  # once it is skipped (a first use); twice in a row, it is the cost
            cost.draft.observe(0, num_draft_tokens, 0, extra)


@dataclass
class WallPlain:
    """``WallCosts``' plain decode step as a ``CostModel`` (``choose_drafts`` prices with it)."""

    costs: WallCosts

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, prefill_pairs: float = 0.0,
                     prefill_scan: float = 0.0) -> float:
        return self.costs.plain_seconds(decode_seqs) if decode_seqs else 0.0

    def observe(self, prefill_tokens: float, decode_seqs: float, seconds: float, prefill_pairs: float = 0.0,
                prefill_scan: float = 0.0) -> None:
        return None

    def overrun(self) -> float:
        return 1.0


class WallPolicy:
    """The drafts-per-step plan priced in wall time (for n-gram drafts made in the worker, two steps
    in flight): per bucket, with the overlap a drafting run gives up paid when it starts (amortised
    over the mean run length) and a larger margin to start drafting than to go on (hysteresis)."""

    def __init__(self, fallback: CostModel) -> None:
        self.costs = WallCosts(fallback)
        self._run = 0  # drafting steps since the last plain step
        self._run_length = 1.0  # drafting runs' mean length
        self._drafted = False  # the last pass's plan drafted
        self._drafts_next = False  # the last pass drafts or probes: the step read back before it waited for it
        self.measuring = False  # the last pass drafted nothing because its bucket's plain steps are being measured

    def plain_pass(self) -> None:
        """A pass planned without ``choose`` (the speculator's warm-up or refresh): nothing drafted."""
        self._drafted = self._drafts_next = False

    def choose(self, candidates: Sequence[tuple[ScheduledRequest, Pace]], num_decodes: int, max_drafts: int,
               seconds_since_draft: float) -> tuple[DraftPlan, set[str]]:
        """The pass's plan and probers (``seconds_since_draft``: measured since the last drafting step)."""
        plan, probers = self._choose(candidates, num_decodes, max_drafts, seconds_since_draft)
        self._drafts_next = bool(plan.num_drafts or probers)
        return plan, probers

    def _choose(self, candidates: Sequence[tuple[ScheduledRequest, Pace]], num_decodes: int, max_drafts: int,
                seconds_since_draft: float) -> tuple[DraftPlan, set[str]]:
        drafted, self._drafted = self._drafted, False
        self.measuring = bool(num_decodes) and not self.costs.ready(num_decodes)
        if not num_decodes or self.measuring:  # its plain steps measured first
            return NO_DRAFTS, set()
        bucket, plain = self.costs.bucket(num_decodes), WallPlain(self.costs)
        base = plain.step_seconds(0, num_decodes)
        if base <= 0:
            return NO_DRAFTS, set()
        switch, margin = (0.0, MARGIN / 2) if drafted else (bucket.switch / self._run_length, MARGIN)
        buckets = [pace.acceptance.hopeful_bucket for _, pace in candidates]
        plan = choose_drafts(buckets, num_decodes, max_drafts, plain, bucket.draft, overlapped=False, fixed=switch,
                             margin=margin)
        plan = replace(widened(plan, buckets, num_decodes / base, bucket.draft), hopeful=True)
        self._drafted = plan.num_drafts > 0

        def pays(paces: list[Pace]) -> bool:  # a streak of right drafts more would make the plan draft for them
            streaked = [pace.acceptance.bucket_with(PROBE_STREAK) for pace in paces]
            return choose_drafts(streaked, num_decodes, max_drafts, plain, bucket.draft, overlapped=False,
                                 fixed=bucket.switch).num_drafts > 0

        if plan.num_drafts:  # the step verifies drafts anyway: the others probe at their drafts' cost only
            return plan, {request.request_id for request, pace in candidates if not plan.drafts_for(pace.acceptance)}
        probers = choose_probers(candidates, bucket.draft, seconds_since_draft, fixed=bucket.switch, streak_pays=pays)
        return plan, probers

    def account(self, features: StepFeatures, planned_drafts: bool, sizes: Sequence[int],
                seconds: float) -> None:
        """A step's interval: ``features`` (``step_features``), whether its plan had drafts, and the
        drafts the worker verified per drafting request. A plan whose drafts the worker found none of
        is a drafting step of 0 drafted tokens: the worker drained its steps in flight to look them up.
        A plain step followed by a drafting plan (the last pass's, planned before this result with two
        steps in flight) teaches nothing: its read-back waited for that plan."""
        prefill_tokens, num_decodes, pairs, scan = features
        if not any(sizes) and not planned_drafts:  # a plain step
            if self._run:
                self._run_length += RUN_EMA * (self._run - self._run_length)
            if self._run or not self._drafts_next:
                self.costs.observe_plain(num_decodes, prefill_tokens, seconds, after_drafting=bool(self._run))
            self._run = 0
            return
        self._run += 1
        fallback = self.costs.fallback
        prefill = max(fallback.step_seconds(prefill_tokens, num_decodes, pairs, scan)
                      - fallback.step_seconds(0, num_decodes), 0.0) if prefill_tokens else 0.0
        self.costs.observe_drafting(num_decodes, prefill, sum(sizes), seconds)




def widened(plan: DraftPlan, buckets: Sequence[int], plain_rate: float, draft: DraftCost) -> DraftPlan:
    """A drafting plan extended to the requests of lower acceptance whose drafts still gain more
    tokens per second of their own verification than a plain step makes (the step's fixed part is
    paid anyway): left out, such a request would finish last, holding the batch's tail to plain steps."""
    if not plan.num_drafts:
        return plan
    k = plan.num_drafts
    per_request = draft.seconds(0, k) - draft.seconds(0, 0)  # its drafted tokens' verification
    lowest = plan.min_bucket
    for bucket in sorted({b for b in buckets if 0 < b < plan.min_bucket}, reverse=True):
        if per_request > 0 and (expected_tokens(k, bucket / BUCKETS) - 1.0) / per_request < plain_rate:
            break
        lowest = bucket
    return DraftPlan(k, lowest, plan.hopeful)
