"""Prefills sized for their neighbours, on the scheduler's state machine (no processes): chunks of a
1M-token prompt sized by the step cost model so 32 running decodes keep their inter-token target,
vLLM's long-prefill threshold and concurrent partial prefill limits, and a prefill yielding to a
more urgent waiting request at a chunk boundary."""

from __future__ import annotations

import argparse
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from vllm_actors.actors.scheduler.cost_model import FixedCostModel, OnlineCostModel, chunk_pairs, chunk_scan
from vllm_actors.actors.scheduler.prefill_sizing import (
    MAX_CHUNK_GROWTH,
    MIN_CHUNK,
    MIN_SIDE_CHUNK,
    PrefillSizer,
    note_chunk_times,
)
from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.engine_args import add_engine_arguments, engine_kwargs
from vllm_actors.protocol.config import EngineConfig, SchedulerConfig, resolve_scheduler_config
from vllm_actors.protocol.events import PrefillChunk
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams

# An H100-like shape, ten times faster attention than the 1B model's so a 1M prompt moves in a few
# hundred steps: 5 ms a step, 2 us a prefill token, 0.1 ms a decode, 30 us per 2^20 attention pairs.
COST = FixedCostModel(a=0.005, b=2e-6, c=1e-4, d=3e-5)
LONG = 1_000_000


def make(budget: int = 16384, max_model_len: int = 4096, num_blocks: int = 4096, **fields: Any) -> Scheduler:
    config = SchedulerConfig(max_model_len=max_model_len, max_num_seqs=64, max_num_batched_tokens=budget,
                             enable_chunked_prefill=True, block_size=16, num_blocks=num_blocks,
                             max_steps_in_flight=1, enable_prefix_caching=False, **fields)
    return Scheduler(config, cost_model=COST)


def add(request_id: str, prompt_len: int, max_tokens: int = 4, **kwargs: Any) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=[5] * prompt_len,
                      params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_ids=[0], **kwargs)


def the_plan(out: Outputs) -> StepPlan | None:
    plans = [m for m in out.to(KV_CACHE_MANAGER) if isinstance(m, StepPlan)]
    assert len(plans) <= 1
    return plans[0] if plans else None


def finish(scheduler: Scheduler, plan: StepPlan) -> Outputs:
    """The plan's result: each request that completed its tokens samples token 7."""
    sampled = [rid for rid in plan.req_ids if rid in scheduler.requests and scheduler.requests[rid].num_pending]
    return scheduler.handle(StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=sampled,
                                       token_ids=[7] * len(sampled)))


def run(scheduler: Scheduler, out: Outputs, until: Callable[[StepPlan], bool] | None = None,
        max_steps: int = 10_000) -> list[tuple[StepPlan, Outputs]]:
    """Steps until no plan is left (or ``until(plan)`` holds): each plan with its pass's outputs."""
    steps = []
    plan = the_plan(out)
    while plan is not None and len(steps) < max_steps:
        steps.append((plan, out))
        if until is not None and until(plan):
            break
        out = finish(scheduler, plan)
        plan = the_plan(out)
    return steps


def chunks(out: Outputs, request_id: str) -> list[PrefillChunk]:
    return [e for e in out.events if isinstance(e, PrefillChunk) and e.request_id == request_id]


def decoding_beside_a_long_prompt(target: float | None) -> tuple[Scheduler, list[tuple[StepPlan, Outputs]]]:
    """32 requests decoding, then a 1M-token prompt arrives: the steps until its last chunk."""
    scheduler = make(max_model_len=LONG + 8, num_blocks=LONG // 16 + 4096, itl_target=target)
    out = Outputs()
    for i in range(32):
        out += scheduler.handle(add(f"d{i}", 16, max_tokens=100_000))
    decoding = run(scheduler, out, until=lambda plan: len(plan.req_ids) == 32 and sum(plan.num_tokens) == 32)
    out = scheduler.handle(add("long", LONG, max_tokens=1))  # arrives while their decode step runs
    out += finish(scheduler, decoding[-1][0])
    steps = run(scheduler, out, until=lambda plan: scheduler.requests["long"].num_pending > 0)
    return scheduler, steps


def test_a_long_prompts_chunks_keep_the_decodes_inter_token_target() -> None:
    target = 0.030
    scheduler, steps = decoding_beside_a_long_prompt(target)
    sizes, starts = [], []
    for plan, out in steps:
        (chunk,) = chunks(out, "long")
        sizes.append(chunk.num_tokens)
        starts.append(chunk.start)
        assert sum(1 for n in plan.num_tokens if n == 1) == 32  # every decode gets its token each step
        predicted = COST.step_seconds(chunk.num_tokens, 32, chunk_pairs(chunk.start, chunk.num_tokens))
        assert predicted <= target or chunk.num_tokens == MIN_CHUNK
    assert starts[-1] + sizes[-1] == LONG  # the whole prompt, chunk after chunk
    # Chunks shrink as the context grows (attention), from the budget-bound start.
    assert sizes[0] > 4 * sizes[-2] and sizes[-2] >= MIN_CHUNK
    assert scheduler.stats.num_preemptions == 0


def test_without_a_target_the_long_prompt_takes_the_whole_budget() -> None:
    _, steps = decoding_beside_a_long_prompt(None)
    (chunk,) = chunks(steps[0][1], "long")
    assert chunk.num_tokens == 16384 - 32
    assert COST.step_seconds(chunk.num_tokens, 32, chunk_pairs(0, chunk.num_tokens)) > 0.030


def test_the_threshold_caps_each_prefill_per_step() -> None:
    scheduler = make(budget=1024, long_prefill_token_threshold=100)
    out = scheduler.handle(add("a", 350))  # planned at once: b joins the next step
    out += scheduler.handle(add("b", 60))
    steps = run(scheduler, out)
    # b, short, is let in first at a's chunk boundary (short_first); a takes its 100 beside it
    assert [plan.num_tokens for plan, _ in steps[:4]] == [[100], [60, 100], [100, 1], [50, 1]]


def test_concurrent_partial_prefills_cap_long_ones_and_let_short_ones_pass() -> None:
    scheduler = make(budget=4096, long_prefill_token_threshold=100, max_num_partial_prefills=3,
                     max_long_partial_prefills=1)
    out = Outputs()
    for name, length in (("long1", 1000), ("long2", 1000), ("short1", 80), ("long3", 1000), ("short2", 90)):
        out += scheduler.handle(add(name, length))
    steps = run(scheduler, out)
    first, second = (dict(zip(plan.req_ids, plan.num_tokens, strict=True)) for plan, _ in steps[:2])
    assert first == {"long1": 100}  # planned on arrival; the others came while it ran
    assert second == {"long1": 100, "short1": 80, "short2": 90}  # long2, long3 passed over, the short let in
    for _, out in steps:
        prefills = [e for e in out.events if isinstance(e, PrefillChunk)]
        assert len(prefills) <= 3 and all(e.num_tokens <= 100 for e in prefills)
        # long: more than the threshold left before the step (vLLM's test)
        assert sum(1 for e in prefills if e.request_id.startswith("long") and 1000 - e.start > 100) <= 1
    assert not scheduler.requests


def test_a_prefill_yields_to_a_more_urgent_request_at_a_chunk_boundary() -> None:
    def second_plan(policy: str) -> dict[str, int]:
        scheduler = make(budget=256, scheduling_policy=policy)
        out = scheduler.handle(add("long", 2000, arrival_time=0.0))
        plan = the_plan(out)
        assert plan is not None and plan.num_tokens == [256]
        out = scheduler.handle(add("short", 200, ttft_deadline=0.5, arrival_time=0.0))
        out += finish(scheduler, plan)
        nxt = the_plan(out)
        assert nxt is not None
        return dict(zip(nxt.req_ids, nxt.num_tokens, strict=True))

    assert second_plan("lrs") == {"short": 200, "long": 56}  # the long prefill takes what is left
    # under fcfs too, by default: the prefill needs more than a step's budget, the short prompt does not
    assert second_plan("fcfs") == {"short": 200, "long": 56}


def test_with_concurrent_partial_prefills_running_requests_go_first() -> None:
    """vLLM V0's rules where ``max_num_partial_prefills`` > 1: a long prefill keeps its place, the
    short prompts share the step's rest (no short first)."""
    scheduler = make(budget=256, long_prefill_token_threshold=128, max_num_partial_prefills=2)
    plan = the_plan(scheduler.handle(add("long", 2000, arrival_time=0.0)))
    assert plan is not None and plan.num_tokens == [128]
    out = scheduler.handle(add("short", 100, arrival_time=0.0))
    out += finish(scheduler, plan)
    nxt = the_plan(out)
    assert nxt is not None and list(zip(nxt.req_ids, nxt.num_tokens, strict=True)) == [("long", 128), ("short", 100)]


@pytest.mark.parametrize("policy", ["fcfs", "priority", "lrs"])
def test_a_long_prefill_lets_short_prompts_in_first_with_a_threshold(policy: str) -> None:
    """With long_prefill_token_threshold a prefill of more than it left lets the waiting short prompts
    in first at its chunk boundary, under any policy, and goes on with what the step has left; a
    prompt as long as it waits its turn (vLLM's order: running requests first)."""
    scheduler = make(budget=1024, max_model_len=LONG + 64, num_blocks=70_000, long_prefill_token_threshold=512,
                     scheduling_policy=policy)
    out = scheduler.handle(add("long", LONG, arrival_time=0.0))
    plan = the_plan(out)
    assert plan is not None and plan.num_tokens == [512]
    out = scheduler.handle(add("short", 300, arrival_time=0.0))
    out += finish(scheduler, plan)
    plan = the_plan(out)
    assert plan is not None and dict(zip(plan.req_ids, plan.num_tokens, strict=True)) == {"short": 300, "long": 512}
    out = scheduler.handle(add("short2", 900, arrival_time=0.0))  # as long as the threshold's chunks: no jump
    out += finish(scheduler, plan)
    plan = the_plan(out)
    # short decodes; short2 is long too: it waits behind the running long prefill, which goes first
    assert plan is not None and dict(zip(plan.req_ids, plan.num_tokens, strict=True)) == {
        "long": 512, "short": 1, "short2": 1024 - 513}


def test_the_online_cost_model_learns_the_attention_term() -> None:
    model = OnlineCostModel()
    truth = FixedCostModel(a=0.004, b=3e-6, c=2e-4, d=2e-4)
    for i in range(400):
        tokens, decodes, start = 512 + 97 * (i % 41), i % 33, (i * 7919) % 900_000
        model.observe(tokens, decodes, truth.step_seconds(tokens, decodes, chunk_pairs(start, tokens)),
                      chunk_pairs(start, tokens))
    late = chunk_pairs(900_000, 2048)
    assert model.step_seconds(2048, 32, late) == pytest.approx(truth.step_seconds(2048, 32, late), rel=0.02)


def test_the_arguments_are_checked_with_vllms_words() -> None:
    with pytest.raises(ValueError, match=r"max_num_partial_prefills \(0\) must be greater than or equal to 1"):
        EngineConfig(model="m", max_num_partial_prefills=0)
    with pytest.raises(ValueError, match="Chunked prefill must be enabled to set max_num_partial_prefills > 1"):
        EngineConfig(model="m", max_num_partial_prefills=2, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match=r"max_long_partial_prefills \(3\) must be .* max_num_partial_prefills \(2\)"):
        EngineConfig(model="m", max_num_partial_prefills=2, max_long_partial_prefills=3)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        EngineConfig(model="m", long_prefill_token_threshold=-1)
    with pytest.raises(ValueError, match="itl_target_ms must be a number of milliseconds > 0"):
        EngineConfig(model="m", itl_target_ms=0)
    with pytest.raises(ValueError, match=r"threshold \(5000\) cannot be greater than the max_model_len \(4096\)"):
        resolve_scheduler_config(EngineConfig(model="m", long_prefill_token_threshold=5000), 4096, 1024)
    # vLLM's default threshold with concurrent partial prefills: 4% of max_model_len.
    config = EngineConfig(model="m", max_num_partial_prefills=2, itl_target_ms=40)
    resolved = resolve_scheduler_config(config, 4096, 1024)
    assert (resolved.long_prefill_token_threshold, resolved.itl_target) == (163, 0.04)


def test_the_serve_flags_carry_vllms_names() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--long-prefill-token-threshold", "2048", "--max-num-partial-prefills", "4",
                              "--max-long-partial-prefills", "2", "--itl-target-ms", "50"])
    kwargs = engine_kwargs(args)
    assert {k: kwargs[k] for k in ("long_prefill_token_threshold", "max_num_partial_prefills",
                                   "max_long_partial_prefills", "itl_target_ms")} == {
        "long_prefill_token_threshold": 2048, "max_num_partial_prefills": 4, "max_long_partial_prefills": 2,
        "itl_target_ms": 50.0}


@dataclass
class _Overrunning(FixedCostModel):
    """COST's coefficients, with mixed steps that ran 1.5x past their prediction of late."""

    def overrun(self) -> float:
        return 1.5


def _beside_decodes(computed: int, last_chunk: int = 0) -> tuple[SchedulerConfig, list[ScheduledRequest],
                                                               ScheduledRequest]:
    config = SchedulerConfig(max_model_len=LONG + 16, max_num_seqs=64, max_num_batched_tokens=16384,
                             enable_chunked_prefill=True, block_size=16, num_blocks=1 << 17, itl_target=0.030)
    decodes = [ScheduledRequest(request_id=f"d{i}", prompt_token_ids=array("i", [5] * 64),
                                params=SamplingParams(max_tokens=8), eos_token_ids=[0], num_computed_tokens=64)
               for i in range(32)]
    long = ScheduledRequest(request_id="long", prompt_token_ids=array("i", [5] * LONG),
                            params=SamplingParams(max_tokens=8), eos_token_ids=[0], num_computed_tokens=computed,
                            last_chunk=last_chunk)
    return config, decodes, long


def test_the_chunk_aims_below_the_target_by_the_overrun() -> None:
    config, decodes, long = _beside_decodes(100_000)
    overrunning = _Overrunning(a=COST.a, b=COST.b, c=COST.c, d=COST.d)
    plain, aimed = (PrefillSizer(config, cost, [*decodes, long]).chunk(long, 16384) for cost in (COST, overrunning))
    seconds = [COST.step_seconds(n, 32, chunk_pairs(100_000, n), chunk_scan(100_000, n)) for n in (plain, aimed)]
    assert MIN_CHUNK < aimed < plain
    assert seconds[0] <= 0.030 < COST.step_seconds(plain + 1, 32, chunk_pairs(100_000, plain + 1),
                                                      chunk_scan(100_000, plain + 1))
    assert seconds[1] <= 0.020 < COST.step_seconds(aimed + 1, 32, chunk_pairs(100_000, aimed + 1),
                                                      chunk_scan(100_000, aimed + 1))


def test_a_chunk_grows_at_most_twice_its_last_where_the_fit_says_larger_is_cheaper() -> None:
    """A fit whose pairs term went below 0 (collinear with the scan at one context) predicts a whole 4,096-token
    chunk within the target: the chunk grows from the last one by MAX_CHUNK_GROWTH at most."""
    collinear = FixedCostModel(a=0.005, b=2e-6, c=1e-4, d=-1e-5, e=2e-4)
    config, decodes, long = _beside_decodes(400_000, last_chunk=300)
    sizer = PrefillSizer(config, collinear, [*decodes, long])
    assert collinear.step_seconds(4096, 32, chunk_pairs(400_000, 4096), chunk_scan(400_000, 4096)) < 0.030
    assert sizer.chunk(long, 4096) == MAX_CHUNK_GROWTH * 300
    sizer.took(long, MAX_CHUNK_GROWTH * 300)
    assert long.last_chunk == 600
    fresh = _beside_decodes(400_000)[2]  # no chunk yet: nothing to grow from
    assert PrefillSizer(config, collinear, [*decodes, fresh]).chunk(fresh, 4096) == 4096


def test_a_chunk_too_small_to_pay_for_its_scan_waits_beside_other_prefills() -> None:
    """A short prompt took most of the target: the long prompt's chunk that would fit is tiny, and scans its 600k
    keys all the same; it waits a step. As the step's first prefill it gets MIN_CHUNK (it always moves)."""
    config, decodes, long = _beside_decodes(600_000)
    short = ScheduledRequest(request_id="short", prompt_token_ids=array("i", [5] * 2048),
                             params=SamplingParams(max_tokens=8), eos_token_ids=[0])
    cost = FixedCostModel(a=0.005, b=2e-6, c=1e-4, d=3e-5, e=1.2e-4)  # the scan of 600k keys: 17.6 ms
    sizer = PrefillSizer(config, cost, [*decodes, long])
    sizer.took(short, sizer.chunk(short, 2048))
    assert short.last_chunk == 2048
    fits = next(n for n in range(4096, 0, -1) if sizer._step_seconds(600_000, n) <= 0.030)
    assert 0 < fits < MIN_SIDE_CHUNK and sizer.chunk(long, 4096) == 0
    assert PrefillSizer(config, cost, [*decodes, long]).chunk(long, 4096) >= MIN_CHUNK


def test_a_chunk_measured_past_the_target_shrinks_the_next_where_the_fit_lags() -> None:
    """The fit says a 2,048-token chunk at 690k keeps the 30 ms target; the step that held the last 1,024 took
    60 ms (H200: as the fit lagged, 1,024 -> 2,048 -> 4,096-token chunks made 288, 455 and 894 ms steps). The
    next chunk takes the room the step leaves in proportion to what the measured one took, not the fit's."""
    collinear = FixedCostModel(a=0.005, b=2e-6, c=1e-4)  # its attention terms lost (collinear, fitted near 0)
    config, decodes, long = _beside_decodes(690_000, last_chunk=1024)
    requests = {request.request_id: request for request in [*decodes, long]}
    assert PrefillSizer(config, collinear, [*decodes, long]).chunk(long, 4096) == MAX_CHUNK_GROWTH * 1024

    def measured(seconds: float, execute: float = 0.0) -> None:
        plan = StepPlan(step_id=1, req_ids=[*(d.request_id for d in decodes), "long"], num_tokens=[1] * 32 + [1024],
                        num_blocks=[5] * 32 + [(690_000 + 1024) // 16])
        note_chunk_times(plan, StepResult(step_id=1, req_ids=[d.request_id for d in decodes], token_ids=[7] * 32,
                                          interval_seconds=seconds, execute_seconds=execute), requests, collinear, 16)

    measured(0.060)
    rest = collinear.step_seconds(0, 32)  # the step without the chunk: its decodes
    assert long.timed_chunk == 1024 and long.chunk_seconds == pytest.approx(0.060 - rest)
    chunk = PrefillSizer(config, collinear, [*decodes, long]).chunk(long, 4096)
    assert MIN_CHUNK < chunk == int(1024 * (0.030 - rest) / (0.060 - rest))
    measured(0.001, execute=0.2)  # read back with the step before (its wall share next to nothing): no measure
    assert long.chunk_seconds == pytest.approx(0.060 - rest)
    measured(0.012)  # well under: it may grow, by MAX_CHUNK_GROWTH at most
    assert PrefillSizer(config, collinear, [*decodes, long]).chunk(long, 4096) == MAX_CHUNK_GROWTH * 1024


def test_a_guest_on_borrowed_kv_is_not_shrunk_for_the_target() -> None:
    """A request on borrowed KV waits on its lenders at every layer whatever its chunk (H200: 64-token chunks
    made 180-300 ms steps): the target does not shrink it, where the same request without a loan gets MIN_CHUNK."""
    config, decodes, long = _beside_decodes(600_000, last_chunk=64)
    slow = FixedCostModel(a=0.250, b=2e-6, c=1e-4, d=3e-5)  # every step over the 30 ms target
    assert PrefillSizer(config, slow, [*decodes, long]).chunk(long, 4096) == MIN_CHUNK
    long.borrowed = [[1, 20_000]]
    assert PrefillSizer(config, slow, [*decodes, long]).chunk(long, 4096) == 4096
    capped = msgspec.structs.replace(config, long_prefill_token_threshold=2048)
    assert PrefillSizer(capped, slow, [*decodes, long]).chunk(long, 4096) == 2048
