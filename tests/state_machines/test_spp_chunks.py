"""Sequence pipeline parallelism's chunk sizes from the step cost model: equal predicted times per
chunk, larger early and smaller late as attention grows, none above the token budget, the fewest
such chunks; a pass that starts part-way (a prefix hit, chunks already run) continues the plan;
the scheduler under PP plans them."""

from __future__ import annotations

import msgspec
import pytest

from vllm_actors.actors.scheduler.cost_model import FixedCostModel, OnlineCostModel, chunk_pairs
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.actors.scheduler.spp_chunks import MIN_SHARE, balanced_chunk, balanced_chunks, linear_coefficients
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.messages import AddRequest, StepPlan
from vllm_actors.protocol.names import KV_CACHE_MANAGER
from vllm_actors.protocol.sampling import SamplingParams

ATTENTION = FixedCostModel(a=0.005, b=1e-4, c=0.0, d=0.005)  # attention outweighs the rest at 32k


def _times(cost: FixedCostModel, start: int, sizes: list[int]) -> list[float]:
    times, position = [], start
    for size in sizes:
        times.append(cost.step_seconds(size, 0, chunk_pairs(position, size)))
        position += size
    return times


def test_chunks_take_equal_predicted_times_larger_early_within_the_budget() -> None:
    sizes = balanced_chunks(ATTENTION, 0, 32768, 2048, num_stages=1)
    assert sum(sizes) == 32768 and max(sizes) <= 2048
    assert sizes[0] >= 1900 and sizes[-1] < sizes[0] // 2  # the first fills the budget; late ones are small
    assert all(later <= earlier + 1 for earlier, later in zip(sizes, sizes[1:]))  # shrinking (rounding aside)
    times = _times(ATTENTION, 0, sizes)
    assert max(times) / min(times) < 1.01
    # the fewest such chunks: one fewer, of equal time, would need a first chunk over the budget
    fewer = len(sizes) - 1
    fewer_time = ATTENTION.a + (sum(times) - len(sizes) * ATTENTION.a) / fewer  # the same work in one chunk less
    assert fewer_time > ATTENTION.step_seconds(2048, 0, chunk_pairs(0, 2048))


def test_a_pass_part_way_continues_the_whole_prompts_plan() -> None:
    whole = balanced_chunks(ATTENTION, 0, 32768, 2048, num_stages=1)
    done = sum(whole[:10])
    rest = balanced_chunks(ATTENTION, done, 32768 - done, 2048, num_stages=1)
    assert len(rest) == len(whole) - 10
    assert all(abs(a - b) <= 2 for a, b in zip(rest, whole[10:]))


def test_no_chunk_is_below_a_share_of_the_budget() -> None:
    steep = FixedCostModel(a=0.005, b=1e-4, c=0.0, d=0.02)  # balance would ask for late chunks of ~335
    sizes = balanced_chunks(steep, 0, 32768, 2048, num_stages=1)
    assert sum(sizes) == 32768 and min(sizes) == 2048 // MIN_SHARE == sizes[-2]
    assert sizes[0] > 2 * sizes[10] > 2 * sizes[-2]  # still larger early, smaller late
    noisy = FixedCostModel(a=0.0, b=0.0, c=0.0, d=1.0)  # a fit that sees attention alone
    assert min(balanced_chunks(noisy, 0, 2000, 64, num_stages=1)) >= 64 // MIN_SHARE


def test_without_attention_the_chunks_are_equal_and_a_short_prompt_is_one_chunk() -> None:
    assert balanced_chunks(FixedCostModel(d=0.0), 0, 40, 16, num_stages=1) == [13, 14, 13]
    assert balanced_chunks(FixedCostModel(a=0.0, b=0.0, c=0.0, d=0.0), 0, 40, 16, num_stages=1) == [14, 13, 13]
    assert balanced_chunks(ATTENTION, 0, 16, 16, num_stages=1) == [16]
    assert linear_coefficients(OnlineCostModel()) == pytest.approx((0.01, 0.0001, 0.0003))
    with pytest.raises(ValueError, match="positive budget"):
        balanced_chunk(ATTENTION, 0, 10, 0, num_stages=1)


def test_the_scheduler_under_pp_plans_the_balanced_chunks() -> None:
    config = SchedulerConfig(max_model_len=8192, max_num_seqs=4, max_num_batched_tokens=512,
                             enable_chunked_prefill=True, block_size=16, num_blocks=600, max_steps_in_flight=64,
                             enable_prefix_caching=False, pipeline_parallel_size=2)
    scheduler = Scheduler(config, cost_model=ATTENTION)
    out = scheduler.handle(AddRequest(request_id="long", prompt_token_ids=[1] * 8000,
                                      params=SamplingParams(max_tokens=2), eos_token_ids=[0]))
    plans = [message for message in out.to(KV_CACHE_MANAGER) if isinstance(message, StepPlan)]
    assert [plan.num_tokens[0] for plan in plans] == balanced_chunks(ATTENTION, 0, 8000, 512, num_stages=2)
    assert plans[0].num_tokens[0] > plans[-1].num_tokens[0] + 100
    unpipelined = Scheduler(msgspec.structs.replace(config, pipeline_parallel_size=1), cost_model=ATTENTION)
    first = unpipelined.handle(AddRequest(request_id="long", prompt_token_ids=[1] * 8000,
                                          params=SamplingParams(max_tokens=2), eos_token_ids=[0]))
    sizes = [plan.num_tokens[0] for plan in first.to(KV_CACHE_MANAGER) if isinstance(plan, StepPlan)]
    assert sizes[:16] == [512] * 15 + [320]  # without a pipeline: the budget's chunks, as before
