"""How many tokens to draft per step: "never slower" than not speculating.

Chosen once per planning pass for the whole batch (``choose_drafts``), from three estimates:

- a plain step's seconds for ``B`` decodes, by the scheduler's step cost model (fed by the steps
  that verify no drafts);
- the extra seconds of a step verifying drafts (``DraftCost``): ``e + p * k + t * n + u * c`` for
  ``k`` drafts per drafting request, ``n`` drafted tokens in the step and ``c`` tokens the drafter
  catches up on (each drafting request's tokens since it last drafted), fitted online from each
  drafting step's measured time less the plain step's prediction for the same requests. It holds
  what verification adds (the drafted tokens and the step's path) and, for a draft model or an
  EAGLE-3 head, their forward passes, which run inside the measured step;
- each request's acceptance (``Acceptance``): with ``alpha`` the chance that a draft is right given
  those before it were, a step verifying ``k`` drafts gains ``(1 - alpha ** (k + 1)) / (1 - alpha)``
  tokens instead of one; where its lookups find fewer drafts than planned (n-gram: a match near the
  end of the text), ``k`` is at most what they find (``reach``), which its buckets fold in.

The plan (``DraftPlan``): the ``m`` requests of highest acceptance draft ``k`` tokens each, the
``(k, m)`` of the most expected tokens per second, and none unless that beats not drafting by
``MARGIN``. With two steps in flight a drafting request waits for its step's result, so the
others run a plain step of their own in between: the rate is counted over that cycle. At large
batches ``t * n`` outgrows the gain, and ``k`` falls, one by one, to 0: no cliff at a batch-size
threshold. Probes (``Speculator``) keep the estimates alive while nothing is drafted.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from vllm_actors.actors.scheduler.cost_model import CostModel, OnlineCostModel

MARGIN = 0.05  # a drafting plan must promise 5% more tokens per second than not drafting
PRIOR_ACCEPTED = 1.0  # the acceptance of a request not yet observed: 1 in 2
PRIOR_TRIALS = 2.0
RECENT_TRIALS = 8.0  # the weight of the recent requests' acceptance in a new request's
DECAY = 0.95  # per drafting step, the past weighs this much less (toward the prior)
BUCKETS = 32  # acceptances are grouped in steps of 1/32 when planning
REACH_PRIOR = 1.0  # lookups weighing this much find every draft planned before any is counted


def expected_tokens(k: float, alpha: float) -> float:
    """Tokens a request gains from a step verifying ``k`` drafts accepted with probability
    ``alpha`` each (the bonus token included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@lru_cache(maxsize=64)
def _tokens_by_bucket(depth: int) -> tuple[float, ...]:
    return tuple(expected_tokens(depth, bucket / BUCKETS) for bucket in range(BUCKETS + 1))


def reach_bucket(alpha: float, reach: float, depth: int) -> int:
    """The bucket whose ``depth`` drafts gain what ``reach`` drafts (a mean: the lookups' finds) of
    acceptance ``alpha`` do: the plan prices every request's drafts by one acceptance."""
    target = expected_tokens(reach, alpha)  # a fractional count: the mean
    table = _tokens_by_bucket(depth)
    above = bisect_left(table, target)
    if above > BUCKETS:
        return BUCKETS
    return above if not above or table[above] - target < target - table[above - 1] else above - 1


@dataclass
class Acceptance:
    """A request's per-draft acceptance: the right drafts over the drafts tested (those up to and
    including the first wrong one; the ones after it are never tested), decayed toward the prior;
    and its lookups' ``reach``: the drafts they find of the ``depth`` planned (the most planned for
    it), counted where that says how far they reach (fewer found than planned, or all of a plan of
    ``depth``), decayed toward finding them all."""

    accepted: float = PRIOR_ACCEPTED
    trials: float = PRIOR_TRIALS
    prior: float = PRIOR_ACCEPTED / PRIOR_TRIALS  # what it decays toward
    found: float = 0.0  # the drafts the counted lookups found (at most ``depth`` each), decayed
    looks: float = 0.0  # the counted lookups, decayed
    depth: int = 0

    @classmethod
    def starting_at(cls, recent: Acceptance) -> Acceptance:
        """A request's acceptance before any of its drafts is verified: the recent requests' (so
        that a new request of a workload drafts as the ones before it), weighing as
        ``RECENT_TRIALS`` drafts once they are measured (a wrong first draft then lowers it a
        little, not below what drafting needs)."""
        trials = RECENT_TRIALS if recent.trials > PRIOR_TRIALS else PRIOR_TRIALS
        return cls(accepted=recent.alpha * trials, trials=trials, prior=recent.alpha)

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    @property
    def reach(self) -> float:
        """The drafts its lookups find, of ``depth`` planned (``depth`` where none was counted)."""
        return (self.found + self.depth * REACH_PRIOR) / (self.looks + REACH_PRIOR)

    @property
    def bucket(self) -> int:
        return self.bucket_with(0)

    @property
    def hopeful_bucket(self) -> int:
        """The bucket with one right draft more: a request of few verified drafts gets the benefit
        of the doubt (a wrong first draft does not stop it), which fades as its drafts are counted."""
        return self.bucket_with(1)

    def bucket_with(self, right: int) -> int:
        """The bucket with ``right`` right drafts more, its lookups' reach folded in."""
        alpha = (self.accepted + right) / (self.trials + right)
        reach = self.reach
        if reach >= self.depth:
            return round(alpha * BUCKETS)
        return reach_bucket(alpha, reach, self.depth)

    def observe(self, num_drafted: int, num_accepted: int, num_planned: int = 0) -> None:
        """One step's verification (``num_drafted`` 1, ``num_accepted`` 0: a proposal that found
        nothing, which held the request to one step in flight for nothing); ``num_planned``: the
        drafts planned where the lookup was made in the worker (0: not counted for ``reach``)."""
        rejected = 1.0 if num_accepted < num_drafted else 0.0
        self.accepted = self.accepted * DECAY + self.prior * PRIOR_TRIALS * (1 - DECAY) + num_accepted
        self.trials = self.trials * DECAY + PRIOR_TRIALS * (1 - DECAY) + num_accepted + rejected
        if num_planned:
            self.depth = max(self.depth, num_planned)
            if num_drafted < num_planned or num_planned == self.depth:  # else it might have found more
                self.found = self.found * DECAY + min(num_drafted, self.depth)
                self.looks = self.looks * DECAY + 1.0


@dataclass
class DraftCost:
    """A drafting step's seconds beyond a plain step's: ``e + p * k + t * n + u * c``, fitted
    online (recursive least squares: the step cost model's, its first four features these, the fifth unused).
    Starts at 0 (a fresh engine tries)."""

    model: OnlineCostModel = field(default_factory=lambda: OnlineCostModel(prior=(0.0,) * 5, forgetting=0.98))

    def seconds(self, num_drafts: int, num_draft_tokens: int, num_catch_up: int = 0) -> float:
        fixed, per_pass, per_token, per_catch_up = self.coefficients
        return fixed + per_pass * num_drafts + per_token * num_draft_tokens + per_catch_up * num_catch_up

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """``(e, p, t, u)``, each at least 0: steps seen at one ``k`` only (probes) leave the split
        between ``e`` and ``p`` open, and a negative one would make more drafts look cheaper."""
        fixed, per_token, per_pass, per_catch_up = (max(0.0, float(x)) for x in self.model.theta[:4])
        return fixed, per_pass, per_token, per_catch_up

    def observe(self, num_drafts: int, num_draft_tokens: int, num_catch_up: int, extra_seconds: float) -> None:
        self.model.observe(num_draft_tokens, num_drafts, extra_seconds, num_catch_up)


@dataclass(frozen=True)
class DraftPlan:
    """A planning pass's drafting: requests whose acceptance bucket is at least ``min_bucket``
    draft ``num_drafts`` tokens each (0: nobody drafts)."""

    num_drafts: int = 0
    min_bucket: int = BUCKETS + 1
    hopeful: bool = False  # the buckets are ``Acceptance.hopeful_bucket``

    def drafts_for(self, acceptance: Acceptance) -> int:
        bucket = acceptance.hopeful_bucket if self.hopeful else acceptance.bucket
        return self.num_drafts if bucket >= self.min_bucket else 0


NO_DRAFTS = DraftPlan()


def choose_drafts(buckets: Sequence[int], num_decodes: int, max_drafts: int, plain: CostModel, extra: DraftCost,
                  overlapped: bool = True, fixed: float = 0.0, margin: float = MARGIN) -> DraftPlan:
    """The pass's plan. ``buckets``: the acceptance buckets of the requests that may draft;
    ``num_decodes``: the decoding requests of the step (those included); ``overlapped``: two steps
    in flight (a drafting request's step then costs the others a plain step in between); ``fixed``:
    seconds a drafting step costs beyond ``extra`` (the overlap given up after it, amortised);
    ``margin``: how much more a plan must promise than not drafting (hysteresis: none to keep drafting)."""
    if max_drafts < 1 or num_decodes < 1 or not buckets:
        return NO_DRAFTS
    base = plain.step_seconds(0, num_decodes)
    if base <= 0:
        return NO_DRAFTS
    groups = sorted(((b, n) for b, n in Counter(buckets).items() if b > 0), reverse=True)
    rest_seconds = []  # the plain step in between of those not drafting, after each group
    drafting = 0
    for _, count in groups:
        drafting += count
        rest = max(num_decodes - drafting, 0)
        rest_seconds.append(plain.step_seconds(0, rest) if overlapped and rest else 0.0)
    extra_fixed, per_pass, per_token, per_catch_up = extra.coefficients
    best, best_rate = NO_DRAFTS, num_decodes / base
    for k in range(1, max_drafts + 1):
        drafting, gain = 0, 0.0
        for (bucket, count), between in zip(groups, rest_seconds, strict=True):
            drafting += count
            gain += count * (expected_tokens(k, bucket / BUCKETS) - 1.0)
            catch_up = drafting + gain  # in steady drafting: the tokens each gained last step
            seconds = (base + fixed + extra_fixed + per_pass * k + per_token * k * drafting
                       + per_catch_up * catch_up + between)
            tokens = num_decodes + gain + (max(num_decodes - drafting, 0) if between else 0)
            rate = tokens / (seconds * (1.0 + margin))
            if rate > best_rate:
                best, best_rate = DraftPlan(k, bucket), rate
    return best
