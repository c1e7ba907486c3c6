"""Sequence pipeline parallelism's chunk sizes from the step cost model: equal predicted times per
chunk, larger early and smaller late as attention grows, none above the token budget, the fewest
such chunks; a pass that starts part-way (a prefix hit, chunks already run) continues the plan;
the scheduler under PP plans them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import msgspec
import pytest
import torch

from vllm_actors.actors.scheduler.cost_model import PAIRS_UNIT, FixedCostModel, OnlineCostModel, chunk_pairs
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.actors.scheduler.spp_chunks import (
    CHUNK_ALIGN,
    MIN_CHUNK_TOKENS,
    MIN_SHARE,
    balanced_chunk,
    balanced_chunks,
    chunk_count,
    chunk_floor,
    in_waves,
    linear_coefficients,
)
from vllm_actors.kernels.attention import attention_wave_tokens
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult
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
    assert [plan.num_tokens[0] for plan in plans] == balanced_chunks(ATTENTION, 0, 8000, 512, num_stages=2,
                                                                      align=CHUNK_ALIGN)
    assert plans[0].num_tokens[0] > plans[-1].num_tokens[0] + 100
    unpipelined = Scheduler(msgspec.structs.replace(config, pipeline_parallel_size=1), cost_model=ATTENTION)
    first = unpipelined.handle(AddRequest(request_id="long", prompt_token_ids=[1] * 8000,
                                          params=SamplingParams(max_tokens=2), eos_token_ids=[0]))
    sizes = [plan.num_tokens[0] for plan in first.to(KV_CACHE_MANAGER) if isinstance(plan, StepPlan)]
    assert sizes[:16] == [512] * 15 + [320]  # without a pipeline: the budget's chunks, as before


# Qwen3-8B's shape on an H200: the per-token and per-pair costs fitted to one stage's TTFTs (1,219 ms at
# 32k, 10,981 ms at 128k, 8,192-token chunks), split evenly over P stages; 2.5 ms a step per stage fits
# the PP=2 TTFT at 32k measured with the fewest-chunks rule (723 ms).
STEP_8B = 0.0025
PAIR_8B = (10.981 - 4 * 1.219) / (8192 - 4 * 512)  # the pairs of 128k and of 32k, in PAIRS_UNIT
TOKEN_8B = (1.219 - 4 * STEP_8B - 512 * PAIR_8B) / 32768


def _stage_8b(num_stages: int) -> FixedCostModel:
    return FixedCostModel(a=STEP_8B, b=TOKEN_8B / num_stages, c=0.0, d=PAIR_8B / num_stages)


def _pipelined_seconds(cost: FixedCostModel, sizes: list[int], num_stages: int) -> float:
    times = _times(cost, 0, sizes)
    return sum(times) + (num_stages - 1) * max(times)


@pytest.mark.parametrize(("length", "num_stages", "bound"),
                         [(32768, 4, 0.35), (131072, 2, 0.55), (131072, 4, 0.3), (32768, 2, 0.57)])
def test_the_count_fills_the_pipe_for_an_8b_shape(length: int, num_stages: int, bound: float) -> None:
    """The predicted TTFT over P stages against one stage's (the budget's chunks): within the
    bounds asked of PP at 32k and 128k. At 32k over 2 stages 2.5 ms a step keeps it above 0.55 at
    any count (sqrt((P-1) W / a) chunks would give 0.558): 16 chunks give 0.562 (a floor of 2,048
    allowed 11: 0.567), the fewest chunks within the budget (6) gave 0.593."""
    one_stage = _pipelined_seconds(_stage_8b(1), [8192] * (length // 8192), 1)
    sizes = balanced_chunks(_stage_8b(num_stages), 0, length, 8192, num_stages=num_stages)
    fewest = balanced_chunks(_stage_8b(num_stages), 0, length, 8192, num_stages=1)
    assert sum(sizes) == length and max(sizes) <= 8192 and min(sizes) >= chunk_floor(8192) == MIN_CHUNK_TOKENS
    assert all(later <= earlier + 2 for earlier, later in zip(sizes, sizes[1:])) and sizes[0] > 2 * sizes[-1]
    ratio = _pipelined_seconds(_stage_8b(num_stages), sizes, num_stages) / one_stage
    assert ratio <= bound
    assert ratio <= _pipelined_seconds(_stage_8b(num_stages), fewest, num_stages) / one_stage


def test_the_count_trades_the_bubble_against_the_steps() -> None:
    """32k over 2 stages: the fewest chunks within the budget at one stage; more (to the floor) as
    the pipe grows; the fewest again when a step's own cost dwarfs the work; the floor's most when
    steps cost nothing of their own."""
    coefficients = linear_coefficients(_stage_8b(2))
    assert chunk_count(coefficients, 32768, 8192, 1) == 6
    assert chunk_count(coefficients, 32768, 8192, 2, min_chunk=2048) == 11  # sqrt(W / a) is 15: the floor's most
    assert chunk_count(coefficients, 32768, 8192, 2) == 16  # the default floor (1,024) lets the count reach it
    assert chunk_count(coefficients, 32768, 65536, 2, min_chunk=2048) == 11  # a budget above the prompt: still split
    assert chunk_count((1.0, *coefficients[1:]), 32768, 8192, 2) == 6
    assert chunk_count((0.0, *coefficients[1:]), 32768, 8192, 2, min_chunk=2048) == 11
    work = coefficients[1] * 32768 + coefficients[2] * chunk_pairs(0, 32768)
    assert chunk_count((3 * work / 64, *coefficients[1:]), 32768, 8192, 4) == 8  # sqrt(3 W / a), between them
    assert chunk_count(coefficients, 4096, 8192, 4, min_chunk=2048) == 1  # two would leave the last under the floor
    assert chunk_count(coefficients, 4096, 8192, 4) == 3  # the default floor (1,024)
    whole = balanced_chunks(_stage_8b(2), 0, 32768, 8192, num_stages=2)
    rest = balanced_chunks(_stage_8b(2), sum(whole[:4]), 32768 - sum(whole[:4]), 8192, num_stages=2)
    assert len(rest) == len(whole) - 4 and all(abs(a - b) <= 2 for a, b in zip(rest, whole[4:]))  # the same plan
    with pytest.raises(ValueError, match="at least one stage"):
        balanced_chunk(ATTENTION, 0, 10, 16, num_stages=0)


def test_the_first_stage_gets_the_chunks_back_to_back() -> None:
    """Four stages, P + 1 steps in flight: the first P + 1 chunks go out at once, and each chunk's
    result sends the next, so the first stage always has a chunk queued behind the one it runs."""
    config = SchedulerConfig(max_model_len=40000, max_num_seqs=4, max_num_batched_tokens=8192,
                             enable_chunked_prefill=True, block_size=16, num_blocks=2600, max_steps_in_flight=5,
                             enable_prefix_caching=False, pipeline_parallel_size=4)
    scheduler = Scheduler(config, cost_model=_stage_8b(4))
    plans = [message for message in scheduler.handle(AddRequest(
        request_id="long", prompt_token_ids=[1] * 32768, params=SamplingParams(max_tokens=2), eos_token_ids=[0],
    )).to(KV_CACHE_MANAGER) if isinstance(message, StepPlan)]
    assert len(plans) == 5
    while len(plans) < 11:
        done = plans[len(plans) - 5]
        out = scheduler.handle(StepResult(step_id=done.step_id, reset=done.reset, req_ids=[], token_ids=[]))
        (plan,) = [message for message in out.to(KV_CACHE_MANAGER) if isinstance(message, StepPlan)]
        plans.append(plan)
    sizes = [plan.num_tokens[0] for plan in plans]
    assert sizes == balanced_chunks(_stage_8b(4), 0, 32768, 8192, num_stages=4, align=CHUNK_ALIGN)[: len(sizes)]
    # each chunk ends on the tiles' 128 rows (a partial tile cost 3.7% more kernel time on an H200)
    assert all(sum(sizes[: i + 1]) % CHUNK_ALIGN == 0 for i in range(len(sizes)))
    assert sizes != balanced_chunks(_stage_8b(4), 0, 32768, 8192, num_stages=4)[: len(sizes)]


def test_the_per_step_part_is_at_most_a_one_sequence_decode_step() -> None:
    # fitted one request at a time, a model knows a + c alone: a large a beside a negative c
    # would plan few chunks (measured: 7 at 32k on two stages where 11 were due)
    degenerate = FixedCostModel(a=0.013, b=1e-5, c=-0.0108, d=5e-4)
    assert linear_coefficients(degenerate) == pytest.approx((0.0022, 1e-5, 5e-4))
    sane = FixedCostModel(a=0.002, b=1e-5, c=0.0003, d=5e-4)
    assert linear_coefficients(sane) == pytest.approx((0.002, 1e-5, 5e-4))
    few = balanced_chunks(degenerate, 0, 32768, 8192, num_stages=2)
    assert len(few) > len(balanced_chunks(FixedCostModel(a=0.013, b=1e-5, c=0.0, d=5e-4), 0, 32768, 8192,
                                          num_stages=2))


def test_a_lower_chunk_floor_lets_the_plan_fill_the_pipe_with_more_chunks() -> None:
    # measured at 32k on two stages: 10 chunks, the last 2,416 tokens; a floor of 1,024 allows more
    model = FixedCostModel(a=0.0005, b=0.323 / 32768, c=0.0, d=0.263 / (32768 * 32768 / 2 / PAIRS_UNIT))
    higher = balanced_chunks(model, 0, 32768, 8192, num_stages=2, align=128, min_chunk=2048)
    lower = balanced_chunks(model, 0, 32768, 8192, num_stages=2, align=128, min_chunk=1024)
    assert min(higher) >= 2048 and len(lower) > len(higher) and min(lower) >= 1024
    assert balanced_chunks(model, 0, 32768, 8192, num_stages=2, align=128) == lower  # the default floor
    assert sum(higher) == sum(lower) == 32768


def test_the_engine_argument_and_its_setting_reach_the_scheduler(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_actors.engine_args import make_engine_config
    from vllm_actors.protocol.config import resolve_scheduler_config

    assert resolve_scheduler_config(make_engine_config("m", {}), 4096, num_blocks=512).spp_min_chunk_tokens == 1024
    monkeypatch.setenv("VLLM_ACTORS_SPP_MIN_CHUNK_TOKENS", "2048")
    assert resolve_scheduler_config(make_engine_config("m", {}), 4096, num_blocks=512).spp_min_chunk_tokens == 2048
    given = make_engine_config("m", {"spp_min_chunk_tokens": 512})
    assert resolve_scheduler_config(given, 4096, num_blocks=512).spp_min_chunk_tokens == 512
    with pytest.raises(ValueError, match="spp_min_chunk_tokens must be a positive integer"):
        make_engine_config("m", {"spp_min_chunk_tokens": 0})


def test_pipelined_chunks_fill_whole_attention_waves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-8B's 32 query heads on an H200's 132 SMs: 528 tokens a wave of flash-attn 4's 128-row
    CTAs. Every chunk but the last ends just under a whole number of waves (the 128-token alignment
    taking the rest), where the plain plan leaves some a part-empty last wave."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    wave = attention_wave_tokens(SimpleNamespace(prefill=object()), torch.device("cuda", 0), 32, 128)
    assert wave == 528
    # Llama-3.2-1B's 32 heads of 64: flash-attn 4 takes 192 rows a CTA there
    assert attention_wave_tokens(SimpleNamespace(prefill=object()), torch.device("cuda", 0), 32, 64) == 792
    assert attention_wave_tokens(SimpleNamespace(prefill=None), torch.device("cuda", 0), 32, 128) == 0  # Triton
    assert attention_wave_tokens(SimpleNamespace(prefill=object()), torch.device("cpu"), 32, 128) == 0
    model = FixedCostModel(a=0.0005, b=0.323 / 32768, c=0.0, d=0.263 / (32768 * 32768 / 2 / PAIRS_UNIT))
    sizes = balanced_chunks(model, 0, 32768, 8192, num_stages=2, align=CHUNK_ALIGN, wave=wave)
    assert sum(sizes) == 32768 and sizes[-1] >= MIN_CHUNK_TOKENS
    assert all(size % CHUNK_ALIGN == 0 and math.ceil(size / wave) * wave - size < CHUNK_ALIGN for size in sizes[:-1])
    plain = balanced_chunks(model, 0, 32768, 8192, num_stages=2, align=CHUNK_ALIGN)
    assert any(math.ceil(size / wave) * wave - size >= CHUNK_ALIGN for size in plain[:-1])
    assert in_waves(0, 1152, 10000, 128, 8192, wave, 1024) == 1024  # 2.2 waves: down to 2
    assert in_waves(0, 1408, 10000, 128, 8192, wave, 1024) == 1536  # 2.7 waves: up to 3
    assert in_waves(0, 1408, 2500, 128, 8192, wave, 1024) == 1024  # up would leave the rest under the floor
    assert in_waves(0, 8192, 20000, 128, 8192, wave, 1024) == 7808  # 15 whole waves within the budget
    assert in_waves(0, 500, 10000, 128, 8192, wave, 1024) == 0  # under a wave, the last chunk, no wave: as before
    assert in_waves(0, 1152, 1152, 128, 8192, wave, 1024) == 0
    assert in_waves(0, 1152, 10000, 128, 8192, 0, 1024) == 0


def test_the_scheduler_plans_pipelined_chunks_in_waves() -> None:
    config = SchedulerConfig(max_model_len=40000, max_num_seqs=4, max_num_batched_tokens=8192,
                             enable_chunked_prefill=True, block_size=16, num_blocks=2600, max_steps_in_flight=3,
                             enable_prefix_caching=False, pipeline_parallel_size=2, attention_wave_tokens=528)
    scheduler = Scheduler(config, cost_model=_stage_8b(2))
    plans = [message for message in scheduler.handle(AddRequest(
        request_id="long", prompt_token_ids=[1] * 32768, params=SamplingParams(max_tokens=2), eos_token_ids=[0],
    )).to(KV_CACHE_MANAGER) if isinstance(message, StepPlan)]
    sizes = [plan.num_tokens[0] for plan in plans]
    assert sizes == balanced_chunks(_stage_8b(2), 0, 32768, 8192, num_stages=2, align=CHUNK_ALIGN,
                                    wave=528)[: len(sizes)]
    assert all(math.ceil(size / 528) * 528 - size < CHUNK_ALIGN for size in sizes)
