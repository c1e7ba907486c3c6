"""The per-step cost model the deadline policies predict with: ``step_seconds = a +
b * prefill_tokens + c * decode_seqs``, fitted online by recursive least squares from each step's
measured execution time (``StepResult.execute_seconds``). A fixed model is injected for tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class CostModel(Protocol):
    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float: ...

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None: ...


@dataclass
class FixedCostModel:
    """Deterministic: the coefficients given, nothing learnt."""

    a: float = 0.01
    b: float = 0.0001
    c: float = 0.0005

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.a + self.b * prefill_tokens + self.c * decode_seqs

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        return None


@dataclass
class OnlineCostModel:
    """Recursive least squares with a forgetting factor (recent steps weigh more), starting from
    a prior guess; predictions are clamped at zero."""

    prior: tuple[float, float, float] = (0.01, 0.0001, 0.0005)
    forgetting: float = 0.99
    theta: np.ndarray = field(init=False)
    covariance: np.ndarray = field(init=False)
    num_observed: int = 0

    def __post_init__(self) -> None:
        self.theta = np.array(self.prior, dtype=np.float64)
        self.covariance = np.eye(3) * 1e3

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return max(0.0, float(self.theta @ np.array([1.0, prefill_tokens, decode_seqs])))

    def observe(self, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        x = np.array([1.0, prefill_tokens, decode_seqs], dtype=np.float64)
        px = self.covariance @ x
        gain = px / (self.forgetting + x @ px)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        self.covariance = (self.covariance - np.outer(gain, px)) / self.forgetting
        self.num_observed += 1
