"""A skewed mixture-of-experts router for benchmarks: expert choice Zipf-distributed, as trained
models route, where random weights route almost uniformly.

With ``zipf:S`` the router's logits of token row ``t`` in layer ``l`` are replaced by row
``(t + l * LAYER_STRIDE) % ROWS`` of one fixed table, ``log(w_e) + g``: ``w_e`` proportional to
``(e + 1) ** -S`` (expert 0 the most chosen) and ``g`` standard Gumbel noise. The top-k of such a row is
a draw of k experts without replacement with probabilities proportional to ``w`` (the Gumbel top-k
trick), so over a batch the experts' loads follow the Zipf law (``zipf:0``: uniform draws). The routing
weights are the softmax of the row at the chosen experts, renormalised as the model's config says.

The table is the same wherever it is built: its noise comes from Python's ``random`` with a fixed seed
and its values are rounded to bfloat16 (so a bfloat16, float16 or float32 router holds them exactly).
Both engines of a comparison use this file (vLLM's peer: ``benchmarks/lib/peer_vllm_skew.py``, with
this file copied beside it), so both route alike. It imports nothing of vllm_actors, and torch only
where a table is built (``envs`` parses the setting with ``parse_skew``).
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROWS = 4096  # token rows of the table; a step of more tokens reuses rows
LAYER_STRIDE = 997  # rows between two layers' first rows (a prime: layers draw apart)
SEED = 20260101
_SPEC = re.compile(r"zipf:([0-9]*\.?[0-9]+)")


@dataclass(frozen=True)
class RouterSkew:
    """``zipf:S``: expert ``e`` drawn with weight ``(e + 1) ** -S``."""

    exponent: float

    @property
    def spec(self) -> str:
        return f"zipf:{self.exponent:g}"

    def weights(self, num_experts: int) -> list[float]:
        """The experts' draw probabilities (summing to 1)."""
        raw = [(expert + 1) ** -self.exponent for expert in range(num_experts)]
        total = sum(raw)
        return [value / total for value in raw]


def parse_skew(text: str) -> RouterSkew:
    """``zipf:S`` with a number ``S >= 0`` (e.g. ``zipf:1.2``)."""
    match = _SPEC.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError("must be zipf:S with a number S >= 0 (e.g. zipf:1.2)")
    return RouterSkew(float(match.group(1)))


def table_values(skew: RouterSkew, num_experts: int, rows: int = ROWS) -> list[list[float]]:
    """The table's rows before rounding: ``log(w_e)`` plus Gumbel noise, from ``random.Random(SEED)``."""
    logs = [math.log(weight) for weight in skew.weights(num_experts)]
    rng = random.Random(SEED)
    return [[logs[expert] - math.log(-math.log(max(rng.random(), 1e-300))) for expert in range(num_experts)]
            for _ in range(rows)]


def make_table(skew: RouterSkew, num_experts: int, device: Any = "cpu", rows: int = ROWS) -> torch.Tensor:
    """[rows, num_experts] float32 on ``device``, every value a bfloat16 one."""
    import torch

    table = torch.tensor(table_values(skew, num_experts, rows), dtype=torch.float32)
    return table.to(torch.bfloat16).to(torch.float32).to(device)


def skewed_logits(table: torch.Tensor, num_tokens: int, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """The router logits of a step of ``num_tokens`` rows in layer ``layer``: [num_tokens, experts]."""
    import torch

    rows = (torch.arange(num_tokens, device=table.device) + layer * LAYER_STRIDE) % table.shape[0]
    return table.index_select(0, rows).to(dtype)


def choice_shares(table: torch.Tensor, top_k: int) -> list[float]:
    """Each expert's share of the choices the table's rows make (k per row; the shares sum to 1)."""
    import torch

    ids = torch.topk(table, top_k, dim=-1).indices.reshape(-1)
    counts = torch.bincount(ids, minlength=table.shape[1]).double()
    return (counts / counts.sum()).tolist()


def describe(skew: RouterSkew, num_experts: int, top_k: int) -> dict[str, Any]:
    """What a results file records of the skew: the spec and the loads it gives, from the table."""
    shares = choice_shares(make_table(skew, num_experts), top_k)
    ordered = sorted(shares, reverse=True)
    cumulative, half = 0.0, 0
    while cumulative < 0.5:
        cumulative += ordered[half]
        half += 1
    return {"spec": skew.spec, "num_experts": num_experts, "top_k": top_k, "rows": ROWS,
            "hottest_expert_share": ordered[0], "hottest_over_uniform": ordered[0] * num_experts,
            "experts_taking_half_the_choices": half, "coldest_expert_share": ordered[-1]}
