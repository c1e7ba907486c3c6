"""Chunk sizes of a long prompt under sequence pipeline parallelism, from the step cost model.

The chunks of one prompt flow through the stages back to back, so the prefill takes about
``sum(t_i) + (P - 1) * max(t_i)`` for chunk times ``t_i`` over ``P`` stages: for a given number of
chunks, equal predicted times are the fastest. A chunk's time grows with the keys it attends to
(the cost model's ``prefill_pairs``), so equal times mean larger chunks early and smaller ones
late. With ``C`` chunks of equal time, a model of ``a`` seconds a step and ``W`` seconds of work in
the whole prompt predicts ``(C + P - 1) * (a + W / C)``: more chunks shrink the bubble
``(P - 1) * (a + W / C)`` and add ``a`` each, so the count is the whole number nearest the minimum,
``sqrt((P - 1) * W / a)``, kept between the fewest chunks whose first (largest) keeps within the token
budget and the most whose last (smallest) is not under the floor. One stage has no bubble: the
fewest chunks. No chunk is under the floor, ``MIN_CHUNK_TOKENS`` or ``1 / MIN_SHARE`` of the budget
where that is less: a device runs small chunks inefficiently (the linear model does not see it), and
a model fitted online from noisy step times can ask for chunks of a few tokens.

The sizes are solved in closed form at every chunk (a pass re-solves the chunks left from where
the prompt is, with the model as it has learnt since), so planning costs the same at 1M tokens
as at 10k."""

from __future__ import annotations

import math

from vllm_actors.actors.scheduler.cost_model import PAIRS_UNIT, CostModel, chunk_pairs
from vllm_actors.protocol.config import SPP_MIN_CHUNK_TOKENS

MIN_SHARE = 4  # a chunk takes at least this share of the budget (1 / MIN_SHARE), where the prompt has it left
# The smallest chunk the count plans for by default (SchedulerConfig.spp_min_chunk_tokens sets another): costs
# of small chunks the linear model does not see (protocol/config.py says which).
MIN_CHUNK_TOKENS = SPP_MIN_CHUNK_TOKENS
# A chunk that does not finish its prompt ends on a multiple of this: the GEMMs' and flash-attn's 128-row
# tiles run a partial last tile otherwise (a 32k prefill on the H200 in chunks of 2,736 tokens took 3.7% more
# kernel time than in chunks of 2,048 or 8,192).
CHUNK_ALIGN = 128
_PROBE_TOKENS = 4096  # probe points far from zero: a model clamped at zero is linear there
_PROBE_PAIRS = 64.0

Coefficients = tuple[float, float, float]


def linear_coefficients(cost: CostModel) -> Coefficients:
    """``(a, b, d)``: the model's seconds per step, per prefill token and per unit of
    ``prefill_pairs``, read off by probing it (each at least zero). The per-step part is at most a
    one-sequence decode step's time: a model fitted on steps that always decode one sequence (one
    request at a time) learns that sum alone, and may split it into a large per-step part and a
    negative per-sequence one, which would plan too few chunks."""
    one = cost.step_seconds(_PROBE_TOKENS, 0, 0.0)
    per_token = max(0.0, (cost.step_seconds(2 * _PROBE_TOKENS, 0, 0.0) - one) / _PROBE_TOKENS)
    pairs_one = cost.step_seconds(_PROBE_TOKENS, 0, _PROBE_PAIRS)
    per_pair = max(0.0, (cost.step_seconds(_PROBE_TOKENS, 0, 2 * _PROBE_PAIRS) - pairs_one) / _PROBE_PAIRS)
    per_step = min(one - per_token * _PROBE_TOKENS, cost.step_seconds(0, 1, 0.0))
    return max(0.0, per_step), per_token, per_pair


def chunk_floor(budget: int, min_chunk: int = MIN_CHUNK_TOKENS) -> int:
    """The smallest chunk planned at this token budget (where the prompt has that many left)."""
    return max(1, min(min_chunk, budget // MIN_SHARE))


def _grows(coefficients: Coefficients) -> bool:
    """Whether the model's step time grows with the chunk (else every chunk is predicted alike)."""
    return coefficients[1] > 0.0 or coefficients[2] > 0.0


def _first_chunk(coefficients: Coefficients, start: int, remaining: int, num_chunks: int) -> int:
    """The first of ``num_chunks`` chunks of equal predicted time covering ``remaining`` tokens
    after ``start`` computed ones (the predicted times add up whatever the split: the pairs of
    the whole remainder are the chunks' pairs summed)."""
    a, b, d = coefficients
    if not _grows(coefficients):
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


def _last_chunk(coefficients: Coefficients, length: int, num_chunks: int) -> float:
    """The last of ``num_chunks`` chunks of equal predicted time covering a ``length``-token prompt
    (the smallest: it attends to the most keys)."""
    _, b, d = coefficients
    if not _grows(coefficients):
        return length / num_chunks
    spare = _work(coefficients, length) / num_chunks
    # b*n + d*n*(length - n + (n + 1)/2)/PAIRS_UNIT = spare, for the smaller root n
    quadratic = d / (2 * PAIRS_UNIT)
    linear = b + d * (length + 0.5) / PAIRS_UNIT
    if quadratic <= 0.0:
        return spare / linear
    return 2 * spare / (linear + math.sqrt(max(0.0, linear * linear - 4 * quadratic * spare)))


def _work(coefficients: Coefficients, num_tokens: int) -> float:
    """The predicted seconds of the first ``num_tokens`` of a prompt, less the per-step part
    (with no growth in the model: the tokens themselves, so that sizes come out equal)."""
    _, b, d = coefficients
    if not _grows(coefficients):
        return float(num_tokens)
    return b * num_tokens + d * chunk_pairs(0, num_tokens)


def chunk_count(coefficients: Coefficients, length: int, budget: int, num_stages: int,
                min_chunk: int = MIN_CHUNK_TOKENS) -> int:
    """The number of equal-time chunks of a ``length``-token prompt over ``num_stages`` stages: the
    one the model predicts fastest, ``(C + P - 1) * (a + W / C)``, between the fewest whose first
    chunk is within ``budget`` and the most whose last is not under the floor (the budget first)."""
    low, high = math.ceil(length / budget), length  # the first chunk is the largest: at least the mean
    while low < high:  # the first chunk shrinks as the count grows
        middle = (low + high) // 2
        if _first_chunk(coefficients, 0, length, middle) <= budget:
            high = middle
        else:
            low = middle + 1
    fewest = low
    if num_stages <= 1 or not _grows(coefficients):
        return fewest  # no bubble to shrink, or chunks predicted alike: each one more costs a step
    floor = chunk_floor(budget, min_chunk)
    low, high = fewest, max(fewest, length // floor)
    while low < high:  # the last chunk shrinks as the count grows: the most that keep it at the floor
        middle = (low + high + 1) // 2
        if _last_chunk(coefficients, length, middle) >= floor:
            low = middle
        else:
            high = middle - 1
    most = low
    a, work = coefficients[0], _work(coefficients, length)
    if a <= 0.0:
        return most  # steps cost nothing of their own: the bubble shrinks with every chunk
    best = math.sqrt((num_stages - 1) * work / a)
    candidates = {min(most, max(fewest, count)) for count in (math.floor(best), math.ceil(best))}
    return min(sorted(candidates), key=lambda count: (count + num_stages - 1) * (a + work / count))


def balanced_chunk(cost: CostModel, start: int, remaining: int, budget: int, *, num_stages: int,
                   align: int = 1, min_chunk: int = MIN_CHUNK_TOKENS, wave: int = 0) -> int:
    """The next chunk of a prompt with ``remaining`` tokens to compute after ``start``, pipelined
    over ``num_stages`` stages. The plan is the whole prompt's: ``chunk_count`` chunks of equal
    predicted time (the first is the largest); this pass takes its share of what the plan has left
    from ``start`` (a prefix-cache hit or the chunks already run), solved again from here; ``align``:
    a chunk that does not finish the prompt ends on a multiple of it (the scheduler's: ``CHUNK_ALIGN``);
    ``wave``: its tokens fill whole waves of the attention kernel's CTAs (``in_waves``; 0: no rounding)."""
    if remaining <= 0 or budget <= 0 or num_stages <= 0:
        raise ValueError(f"a prefill chunk needs tokens left, a positive budget and at least one stage, got "
                         f"remaining={remaining}, budget={budget}, num_stages={num_stages}")
    length = start + remaining
    if length <= budget and num_stages == 1:
        return remaining
    coefficients = linear_coefficients(cost)
    count = chunk_count(coefficients, length, budget, num_stages, min_chunk)
    if count == 1:
        return remaining
    per_chunk = _work(coefficients, length) / count  # each chunk's share of the work
    num_left = max(1, round(count - _work(coefficients, start) / per_chunk)) if per_chunk > 0.0 else 1
    floor = chunk_floor(budget, min_chunk)
    # where the plan's chunks would fall under the floor, the rest goes in equal chunks of at least it
    even = math.ceil(remaining / max(1, remaining // floor))
    size = min(budget, remaining, max(even, _first_chunk(coefficients, start, remaining, num_left)))
    if 0 < remaining - size < floor:  # no chunk of a few tokens at the end
        size = remaining if remaining <= budget else remaining - floor
    return in_waves(start, size, remaining, align, budget, wave, floor) or aligned(start, size, remaining, align,
                                                                                  budget)


def in_waves(start: int, size: int, remaining: int, align: int, budget: int, wave: int, floor: int) -> int:
    """``size`` moved to the nearest whole number of attention waves (``wave`` tokens each; then down to
    ``align``), where that leaves the prompt's rest at least ``floor`` tokens and keeps within the budget;
    0 where it does not apply (no wave, a chunk under one, the prompt's last chunk). Attention over a long
    context dominates a late chunk's time, and its CTAs run in waves of one per SM: a chunk just past a
    whole number of waves runs a nearly empty one (1,152 tokens took 1.37x 1,024's time at 120k keys)."""
    if wave <= 0 or size < wave or size >= remaining:
        return 0
    for waves in sorted({min(max(1, round(size / wave)), budget // wave), size // wave}, reverse=True):
        end = (start + waves * wave) // max(1, align) * max(1, align)
        moved = end - start
        if 0 < moved < remaining and remaining - moved >= floor and moved * 2 > size:
            return moved
    return 0


def aligned(start: int, size: int, remaining: int, align: int, budget: int) -> int:
    """``size`` moved so that a chunk which does not finish the prompt ends on the nearest multiple of
    ``align`` (up only within the budget and short of the prompt's end). Chunks under four times
    ``align`` are left as they are: a partial tile weighs little beside their steps' fixed cost."""
    if size >= remaining or align <= 1 or size < 4 * align:
        return size
    end = start + size
    down, up = end // align * align, -(-end // align) * align
    if up - end <= end - down and up - start <= budget and up - start < remaining:
        return up - start
    return down - start


def balanced_chunks(cost: CostModel, start: int, length: int, budget: int, *, num_stages: int,
                    align: int = 1, min_chunk: int = MIN_CHUNK_TOKENS, wave: int = 0) -> list[int]:
    """Every chunk of a ``length``-token prefill after ``start`` computed tokens, as the scheduler
    takes them one pass after another (a fixed model: the same sizes as planned)."""
    sizes: list[int] = []
    done = 0
    while done < length:
        sizes.append(balanced_chunk(cost, start + done, length - done, budget, num_stages=num_stages, align=align,
                                    min_chunk=min_chunk, wave=wave))
        done += sizes[-1]
    return sizes
