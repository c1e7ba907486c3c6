"""Chunk sizes of a long prompt under sequence pipeline parallelism, from the step cost model.

The chunks of one prompt flow through the stages back to back, so the prefill takes about
``sum(t_i) + (P - 1) * max(t_i)`` for chunk times ``t_i`` over ``P`` stages: for a given number of
chunks, equal predicted times are the fastest. A chunk's time grows with the keys it attends to
(the cost model's ``prefill_pairs``), so equal times mean larger chunks early and smaller ones
late. The count is the smallest whose first (largest) chunk keeps within the token budget. No
chunk is smaller than ``1 / MIN_SHARE`` of the budget: a device runs tiny chunks inefficiently (the
linear model does not see it), and a model fitted online from noisy step times can ask for chunks
of a few tokens.

The sizes are solved in closed form at every chunk (a pass re-solves the chunks left from where
the prompt is, with the model as it has learnt since), so planning costs the same at 1M tokens
as at 10k."""

from __future__ import annotations

import math

from vllm_actors.actors.scheduler.cost_model import PAIRS_UNIT, CostModel, chunk_pairs

MIN_SHARE = 4  # a chunk takes at least this share of the budget (1 / MIN_SHARE), where the prompt has it left
_PROBE_TOKENS = 4096  # probe points far from zero: a model clamped at zero is linear there
_PROBE_PAIRS = 64.0


def linear_coefficients(cost: CostModel) -> tuple[float, float, float]:
    """``(a, b, d)``: the model's seconds per step, per prefill token and per unit of
    ``prefill_pairs``, read off by probing it (each at least zero)."""
    one = cost.step_seconds(_PROBE_TOKENS, 0, 0.0)
    per_token = max(0.0, (cost.step_seconds(2 * _PROBE_TOKENS, 0, 0.0) - one) / _PROBE_TOKENS)
    pairs_one = cost.step_seconds(_PROBE_TOKENS, 0, _PROBE_PAIRS)
    per_pair = max(0.0, (cost.step_seconds(_PROBE_TOKENS, 0, 2 * _PROBE_PAIRS) - pairs_one) / _PROBE_PAIRS)
    return max(0.0, one - per_token * _PROBE_TOKENS), per_token, per_pair


def _first_chunk(coefficients: tuple[float, float, float], start: int, remaining: int, num_chunks: int) -> int:
    """The first of ``num_chunks`` chunks of equal predicted time covering ``remaining`` tokens
    after ``start`` computed ones (the predicted times add up whatever the split: the pairs of
    the whole remainder are the chunks' pairs summed)."""
    a, b, d = coefficients
    if b <= 0.0 and d <= 0.0:
        return math.ceil(remaining / num_chunks)  # no growth with the tokens: equal sizes
    target = a + (b * remaining + d * chunk_pairs(start, remaining)) / num_chunks
    # a + b*n + d*n*(start + (n + 1)/2)/PAIRS_UNIT = target, for n
    quadratic = d / (2 * PAIRS_UNIT)
    linear = b + d * (start + 0.5) / PAIRS_UNIT
    spare = target - a
    if quadratic <= 0.0:
        size = spare / linear
    else:
        size = 2 * spare / (linear + math.sqrt(linear * linear + 4 * quadratic * spare))  # the stable root
    return min(remaining, max(1, round(size)))


def _work(coefficients: tuple[float, float, float], num_tokens: int) -> float:
    """The predicted seconds of the first ``num_tokens`` of a prompt, less the per-step part
    (with no growth in the model: the tokens themselves, so that sizes come out equal)."""
    _, b, d = coefficients
    if b <= 0.0 and d <= 0.0:
        return float(num_tokens)
    return b * num_tokens + d * chunk_pairs(0, num_tokens)


def balanced_chunk(cost: CostModel, start: int, remaining: int, budget: int) -> int:
    """The next chunk of a prompt with ``remaining`` tokens to compute after ``start``. The plan
    is the whole prompt's: the fewest chunks of equal predicted time none of which is above
    ``budget`` (the first is the largest); this pass takes its share of what the plan has left
    from ``start`` (a prefix-cache hit or the chunks already run), solved again from here."""
    if remaining <= 0 or budget <= 0:
        raise ValueError(f"a prefill chunk needs tokens left and a positive budget, got remaining={remaining}, "
                         f"budget={budget}")
    length = start + remaining
    if length <= budget:
        return remaining
    coefficients = linear_coefficients(cost)
    low, high = math.ceil(length / budget), length  # the first chunk is the largest: at least the mean
    while low < high:  # the first chunk shrinks as the count grows
        middle = (low + high) // 2
        if _first_chunk(coefficients, 0, length, middle) <= budget:
            high = middle
        else:
            low = middle + 1
    per_chunk = _work(coefficients, length) / low  # each chunk's share of the work
    num_left = max(1, round(low - _work(coefficients, start) / per_chunk)) if per_chunk > 0.0 else 1
    floor = max(1, budget // MIN_SHARE)
    size = min(budget, remaining, max(floor, _first_chunk(coefficients, start, remaining, num_left)))
    if 0 < remaining - size < floor:  # no chunk of a few tokens at the end
        size = remaining if remaining <= budget else remaining - floor
    return size


def balanced_chunks(cost: CostModel, start: int, length: int, budget: int) -> list[int]:
    """Every chunk of a ``length``-token prefill after ``start`` computed tokens, as the scheduler
    takes them one pass after another (a fixed model: the same sizes as planned)."""
    sizes: list[int] = []
    done = 0
    while done < length:
        sizes.append(balanced_chunk(cost, start + done, length - done, budget))
        done += sizes[-1]
    return sizes
