"""What a step costs the throughput, as the drafts-per-step policy (``spec_policy``) measures it.

Both estimates are fitted from each step's ``interval_seconds`` (the worker's wall time the step
added: from the later of its launch and the previous step's read-back to its own read-back), not
from ``execute_seconds``: a deferred plain step is launched before the previous one is done, so
its ``execute_seconds`` counts some of that step too, while a drafting step (read back at once)
counts its own only. Compared in that currency, drafting looked cheaper than it is.

- ``PlainCost``: a plain step's seconds, ``a + b * prefill_tokens + c * decode_seqs + d * pairs``;
- ``DraftCost``: what drafting adds, ``e + p * k + t * n + u * c`` for ``k`` drafts per drafting
  request, ``n`` drafted tokens and ``c`` tokens a drafter catches up on.

Both are recursive least squares whose prior uncertainty is smaller on the per-token parts (by
``TOKEN_SCALE``, ``PASS_SCALE``), so that a few steps of one size put most of their cost on the
fixed part (a launch-bound step's, or the overlap a step read back at once loses) rather than on
the per-token parts, which extrapolated to a batch 16 times larger would write drafting off there
unmeasured; steps of other sizes then tell the parts apart. A drafter's catch-up is not scaled (a
draft model's first one is a prefill: per token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from vllm_actors.actors.scheduler.cost_model import OnlineCostModel
from vllm_actors.protocol.messages import StepResult

TOKEN_SCALE = 4.0  # tokens (prefill, decodes, drafted, caught up) per unit of prior uncertainty
PASS_SCALE = 4.0  # drafts per request per unit of prior uncertainty
PRIOR_VARIANCE = 1e3  # the fixed part's (the cost model's own)


def step_seconds(result: StepResult) -> float:
    """The step's measured cost to the throughput (``execute_seconds`` where no interval came)."""
    return result.interval_seconds if result.interval_seconds > 0 else result.execute_seconds


def scaled_model(prior: tuple[float, float, float, float], scales: tuple[float, float, float, float],
                 forgetting: float) -> OnlineCostModel:
    """Recursive least squares whose prior variance of each coefficient is that of the fixed
    part over its feature's scale squared (as if each feature were divided by its scale)."""
    model = OnlineCostModel(prior=prior, forgetting=forgetting)
    model.covariance = np.diag([PRIOR_VARIANCE / scale**2 for scale in scales])
    return model


@dataclass
class PlainCost:
    """A plain step's seconds (no drafts): ``a + b * prefill_tokens + c * decode_seqs + d * pairs``,
    learnt from the plain steps; starts at 10 ms."""

    model: OnlineCostModel = field(default_factory=lambda: scaled_model(
        (0.01, 0.0, 0.0, 0.0), (1.0, TOKEN_SCALE, TOKEN_SCALE, 1.0), forgetting=0.99))

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, prefill_pairs: float = 0.0) -> float:
        return self.model.step_seconds(prefill_tokens, decode_seqs, prefill_pairs)

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float, prefill_pairs: float = 0.0) -> None:
        self.model.observe(prefill_tokens, decode_seqs, seconds, prefill_pairs)


@dataclass
class DraftCost:
    """A drafting step's seconds beyond a plain step's: ``e + p * k + t * n + u * c``, fitted
    online. Starts at 0 (a fresh engine tries)."""

    model: OnlineCostModel = field(default_factory=lambda: scaled_model(
        (0.0, 0.0, 0.0, 0.0), (1.0, TOKEN_SCALE, PASS_SCALE, 1.0), forgetting=0.98))

    def seconds(self, num_drafts: int, num_draft_tokens: int, num_catch_up: int = 0) -> float:
        fixed, per_pass, per_token, per_catch_up = self.coefficients
        return fixed + per_pass * num_drafts + per_token * num_draft_tokens + per_catch_up * num_catch_up

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """``(e, p, t, u)``, each at least 0: a negative one would make more drafts look cheaper."""
        fixed, per_token, per_pass, per_catch_up = (max(0.0, float(x)) for x in self.model.theta)
        return fixed, per_pass, per_token, per_catch_up

    def observe(self, num_drafts: int, num_draft_tokens: int, num_catch_up: int, extra_seconds: float) -> None:
        self.model.observe(num_draft_tokens, num_drafts, extra_seconds, num_catch_up)
