"""How many tokens to draft per step: "never slower" than not speculating.

A step that verifies ``k`` drafted tokens of each of ``B`` decoding requests costs, by the step
cost model (``cost_model``: ``a + b * prefill_tokens + c * decode_seqs``), ``a + b * B * k +
c * B`` plus the step's other work; with a per-token acceptance rate ``alpha`` (drafts accepted
independently, in order) it yields ``(1 - alpha ** (k + 1)) / (1 - alpha)`` tokens per request
instead of one. The policy takes the ``k`` of the best tokens per second, and 0 unless that beats
not speculating by ``MARGIN`` (a speculating request keeps one step in flight instead of two:
the overlap lost is not in the cost model). At large batches ``b * B * k`` outgrows the saving
and the answer falls to 0, smoothly: no cliff at a batch-size threshold.

The acceptance: accepted drafted tokens over drafted tokens, with a prior of ``PRIOR_ACCEPTED``
in ``PRIOR_DRAFTED`` (so a fresh engine tries), old steps decaying toward the prior (``DECAY`` per
step).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_actors.actors.scheduler.cost_model import CostModel

MARGIN = 0.05  # a speculating step must promise 5% more tokens per second than not speculating
PRIOR_ACCEPTED = 1.0
PRIOR_DRAFTED = 2.0
DECAY = 0.98
MIN_ALPHA = 0.02  # below it nothing is drafted


def expected_tokens(k: int, alpha: float) -> float:
    """Tokens a request gains from a step verifying ``k`` drafts accepted with probability
    ``alpha`` each (the bonus token included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def choose_num_drafts(max_drafts: int, alpha: float, num_decodes: int, other_tokens: int, cost: CostModel) -> int:
    """Drafts per speculating request this step (0: do not speculate). ``num_decodes``: the
    decoding requests of the step; ``other_tokens``: its prefill tokens."""
    if max_drafts < 1 or alpha < MIN_ALPHA or num_decodes < 1:
        return 0
    base = cost.step_seconds(other_tokens, num_decodes)
    if base <= 0:
        return 0
    best_k, best_rate = 0, num_decodes / base * (1.0 + MARGIN)
    for k in range(1, max_drafts + 1):
        seconds = cost.step_seconds(other_tokens + num_decodes * k, num_decodes)
        rate = num_decodes * expected_tokens(k, alpha) / max(seconds, 1e-12)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


@dataclass
class Acceptance:
    """Accepted over drafted tokens, decayed: the ``alpha`` of ``choose_num_drafts``."""

    accepted: float = PRIOR_ACCEPTED
    drafted: float = PRIOR_DRAFTED

    @property
    def alpha(self) -> float:
        return self.accepted / self.drafted if self.drafted > 0 else 0.0

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One step's drafts; the past decays toward the prior (a step without drafts moves the
        estimate back toward it, so a request that stopped drafting is tried again later)."""
        self.accepted = self.accepted * DECAY + PRIOR_ACCEPTED * (1 - DECAY) + num_accepted
        self.drafted = self.drafted * DECAY + PRIOR_DRAFTED * (1 - DECAY) + num_drafted
