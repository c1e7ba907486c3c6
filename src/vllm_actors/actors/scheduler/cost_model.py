"""The per-step cost model the deadline policies and prefill sizing predict with: ``step_seconds =
a + b * prefill_tokens + c * decode_seqs + d * prefill_pairs + e * prefill_scan``, fitted online by
recursive least squares from each step's measured wall share (``deadlines.step_wall_seconds``: the
worker's time between its read-backs, what the step's decodes wait between tokens). ``prefill_pairs``
is the attention work of the step's prefill chunks (``chunk_pairs``), query-key pairs in units of
``PAIRS_UNIT``: a chunk late in a 1M-token prompt attends to everything before it and costs more per
token than the first chunk. ``prefill_scan`` is what a chunk pays for scanning its context whatever its
size (``chunk_scan``): its own coefficient, because how much that is depends on the kernel (one CTA per
query tile and head over every key, or the keys split over the SMs). A fixed model is injected for
tests."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy as np

PAIRS_UNIT = float(1 << 20)  # query-key pairs per unit of ``prefill_pairs`` (keeps the features' scales close)
# The covariance's trace is held at most this: forgetting inflates it along features a long run of
# steps never varies (decode-only steps, no prefill), which would otherwise grow without bound.
MAX_COVARIANCE_TRACE = 1e4
# A chunk's attention scans its whole context however few its queries (a CTA per query tile and head, each
# over every key): it costs as if it had this many more. On the H200 (Llama-3.2-1B, flash-attn) 2-12
# tokens at 300k keys added ~60 ms to a step and 256 tokens ~105 ms, where pairs alone make the first
# nearly free (benchmarks/cost_replay.py: the 90th percentile of step prediction errors
# at 200-400k, 41-49% without, 4-6% with). It scales ``chunk_scan`` (the model learns its own coefficient).
CHUNK_SCAN_TOKENS = 256
# Prefill sizing aims below an inter-token target by how far recent mixed steps ran past their prediction:
# this quantile of the last OVERRUN_WINDOW ratios (wall / predicted), once MIN_OVERRUNS were seen, at most
# MAX_OVERRUN. The target is a 99th percentile's (Sarathi-Serve's and Medha's convention for time between
# tokens); on the H200 trace of a 1M-token prompt beside 200 decodes the ratios' p50 / p90 / p99 were
# 0.98 / 1.22 / 1.44 (benchmarks/cost_replay.py).
OVERRUN_QUANTILE = 0.99
OVERRUN_WINDOW = 256
MIN_OVERRUNS = 32
MAX_OVERRUN = 1.6


class StepFeatures(NamedTuple):
    """A step's cost-model features (``deadlines.step_features``)."""

    prefill_tokens: int
    decodes: int
    pairs: float = 0.0  # its chunks' ``chunk_pairs``
    scan: float = 0.0  # their ``chunk_scan``


def chunk_pairs(start: int, num_tokens: int) -> float:
    """The attention work of a prefill chunk of ``num_tokens`` after ``start`` computed tokens: each
    query attends to the keys up to its own position (causal), in units of ``PAIRS_UNIT``."""
    return num_tokens * (start + (num_tokens + 1) / 2) / PAIRS_UNIT


def chunk_scan(start: int, num_tokens: int) -> float:
    """A chunk's scan of the ``start`` keys before it, whatever its size (the step's ``prefill_scan``), in
    ``CHUNK_SCAN_TOKENS`` queries' worth of pairs: 0 for no chunk."""
    return CHUNK_SCAN_TOKENS * start / PAIRS_UNIT if num_tokens else 0.0


class CostModel(Protocol):
    def step_seconds(self, prefill_tokens: int, decode_seqs: int, prefill_pairs: float = 0.0,
                     prefill_scan: float = 0.0) -> float: ...

    def observe(self, prefill_tokens: float, decode_seqs: float, seconds: float,
                prefill_pairs: float = 0.0, prefill_scan: float = 0.0) -> None: ...

    def overrun(self) -> float:
        """How far to aim below a step time target (``Overruns``; 1: not at all)."""
        ...


@dataclass
class Overruns:
    """Recent mixed steps' (prefill beside decodes: those sized for an inter-token target) wall time over
    their prediction; ``factor``: the ``OVERRUN_QUANTILE`` of them, within [1, ``MAX_OVERRUN``]."""

    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=OVERRUN_WINDOW))

    def add(self, predicted: float, seconds: float) -> None:
        if predicted > 0 and seconds > 0:
            self.ratios.append(seconds / predicted)

    def factor(self) -> float:
        if len(self.ratios) < MIN_OVERRUNS:
            return 1.0
        ordered = sorted(self.ratios)
        return min(MAX_OVERRUN, max(1.0, ordered[min(len(ordered) - 1, int(OVERRUN_QUANTILE * len(ordered)))]))


@dataclass
class FixedCostModel:
    """Deterministic: the coefficients given, nothing learnt (``e``: the scan's, None for ``d``'s)."""

    a: float = 0.01
    b: float = 0.0001
    c: float = 0.0005
    d: float = 0.0
    e: float | None = None

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, prefill_pairs: float = 0.0,
                     prefill_scan: float = 0.0) -> float:
        scan = self.d if self.e is None else self.e
        return self.a + self.b * prefill_tokens + self.c * decode_seqs + self.d * prefill_pairs + scan * prefill_scan

    def observe(self, prefill_tokens: float, decode_seqs: float, seconds: float, prefill_pairs: float = 0.0,
                prefill_scan: float = 0.0) -> None:
        return None

    def overrun(self) -> float:
        return 1.0


@dataclass
class OnlineCostModel:
    """Recursive least squares with a forgetting factor (recent steps weigh more), starting from
    a prior guess; predictions are clamped at zero. The covariance is kept symmetric: left to drift,
    its rounding asymmetry grew over thousands of steps whose features span 1 to 1e3 until one update
    threw the predictions off (in the replay of an H200 trace: a 120 ms step predicted at 1.6 s with a scan
    of 512 tokens; the 90th percentile error at 300k 15% unsymmetrised, 5% symmetric)."""

    prior: tuple[float, ...] = (0.01, 0.0001, 0.0005, 0.0003, 0.0003)
    forgetting: float = 0.99
    theta: np.ndarray = field(init=False)
    covariance: np.ndarray = field(init=False)
    num_observed: int = 0
    overruns: Overruns = field(default_factory=Overruns)

    def __post_init__(self) -> None:
        self.theta = np.array(self.prior, dtype=np.float64)
        self.covariance = np.eye(len(self.theta)) * 1e3

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, prefill_pairs: float = 0.0,
                     prefill_scan: float = 0.0) -> float:
        return max(0.0, float(self.theta @ np.array([1.0, prefill_tokens, decode_seqs, prefill_pairs, prefill_scan])))

    def observe(self, prefill_tokens: float, decode_seqs: float, seconds: float, prefill_pairs: float = 0.0,
                prefill_scan: float = 0.0) -> None:
        x = np.array([1.0, prefill_tokens, decode_seqs, prefill_pairs, prefill_scan], dtype=np.float64)
        if prefill_tokens > 0 and decode_seqs > 0:  # a step the prefill sizer sizes: how far it ran past
            self.overruns.add(max(0.0, float(self.theta @ x)), seconds)
        px = self.covariance @ x
        gain = px / (self.forgetting + x @ px)
        self.theta = self.theta + gain * (seconds - x @ self.theta)
        covariance = (self.covariance - np.outer(gain, px)) / self.forgetting
        self.covariance = (covariance + covariance.T) / 2
        trace = float(np.trace(self.covariance))
        if trace > MAX_COVARIANCE_TRACE:
            self.covariance *= MAX_COVARIANCE_TRACE / trace
        self.num_observed += 1

    def overrun(self) -> float:
        return self.overruns.factor()
