"""The cost model taught late (actors/scheduler/late_timings.py): a prefill chunk whose result says
execute_seconds 0 (timed on the GPU) keeps its features until a later result's gpu_timings bring
its time; bounded; a pipeline reset forgets them. The scheduler under PP learns each chunk's GPU time,
and the online model converges on the GPU's costs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from vllm_actors.actors.scheduler.cost_model import (
    MIN_OVERRUNS,
    FixedCostModel,
    OnlineCostModel,
    chunk_pairs,
    chunk_scan,
)
from vllm_actors.actors.scheduler.deadlines import step_features
from vllm_actors.actors.scheduler.late_timings import LateTimings
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.messages import AddRequest, RecoverPipeline, StepGpuTime, StepPlan, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER
from vllm_actors.protocol.sampling import SamplingParams

BLOCK = 16


@dataclass
class _Recorder(FixedCostModel):
    """A fixed model that keeps what it is taught: (prefill tokens, decodes, seconds, pairs and scan)."""

    seen: list[tuple[int, int, float, float]] = field(default_factory=list)

    def observe(self, prefill_tokens: float, decode_seqs: float, seconds: float, prefill_pairs: float = 0.0,
                prefill_scan: float = 0.0) -> None:
        self.seen.append((prefill_tokens, decode_seqs, seconds, prefill_pairs + prefill_scan))


def chunk_attention(start: int, num_tokens: int) -> float:
    """What ``_Recorder`` keeps of a chunk's attention features."""
    return chunk_pairs(start, num_tokens) + chunk_scan(start, num_tokens)


def _chunk(step_id: int, start: int, tokens: int) -> StepPlan:
    blocks = -(-(start + tokens) // BLOCK)
    return StepPlan(step_id=step_id, req_ids=["a"], num_tokens=[tokens], num_blocks=[blocks])


def _result(step_id: int, seconds: float = 0.0, timings: list[StepGpuTime] | None = None,
            interval: float = 0.0) -> StepResult:
    return StepResult(step_id=step_id, req_ids=[], token_ids=[], execute_seconds=seconds, interval_seconds=interval,
                      gpu_timings=timings or [])


def _timed(step_id: int, seconds: float) -> StepGpuTime:
    return StepGpuTime(step_id, seconds, 100.0, 100.0 + seconds)


def test_a_chunk_is_learnt_when_its_gpu_time_comes() -> None:
    cost, late = _Recorder(), LateTimings()
    first, second = _chunk(1, 0, 256), _chunk(2, 256, 256)
    late.observe(cost, first, _result(1), BLOCK)
    assert cost.seen == [] and len(late) == 1  # not measured: kept
    late.observe(cost, second, _result(2, timings=[_timed(1, 0.030), _timed(7, 0.5)]), BLOCK)  # 7: unknown
    assert cost.seen == [(256, 0, 0.030, chunk_pairs(0, 256))] and len(late) == 1
    # measured, but right after a timed step: its time holds step 2's GPU time; step 2 is learnt
    late.observe(cost, _chunk(3, 512, 64), _result(3, 0.004, [_timed(2, 0.040)]), BLOCK)
    assert cost.seen[1:] == [(256, 0, 0.040, chunk_attention(256, 256))]
    late.observe(cost, _chunk(4, 576, 64), _result(4, 0.003), BLOCK)  # measured: held for the next result
    assert cost.seen[-1] == (256, 0, 0.040, chunk_attention(256, 256))
    assert len(late) == 0 and late.num_observed == 2
    late.observe(cost, _chunk(5, 640, 64), _result(5, timings=[_timed(5, 0.006)]), BLOCK)  # its own, at once
    assert cost.seen[-2:] == [(64, 0, 0.003, chunk_attention(576, 64)), (64, 0, 0.006, chunk_attention(640, 64))]
    assert len(late) == 0


def test_steps_that_ran_wait_and_the_wait_is_bounded_and_reset() -> None:
    cost, late = _Recorder(), LateTimings(max_steps=2)
    decode = StepPlan(step_id=1, req_ids=["a"], num_tokens=[1], num_blocks=[1])
    late.observe(cost, decode, _result(1), BLOCK)  # a pipeline's decode step: timed on the GPU too
    assert len(late) == 1
    late.observe(cost, _chunk(9, 0, 1), _result(9, 0.001, [_timed(1, 0.002)]), BLOCK)
    assert cost.seen[-1] == (0, 1, 0.002, 0.0) and len(late) == 0
    cost.seen.clear()
    late.observe(cost, StepPlan(step_id=2), _result(2), BLOCK)  # nothing ran
    drafting = StepPlan(step_id=3, req_ids=["a"], num_tokens=[3], num_blocks=[1], draft_token_ids={"a": [4, 5]})
    late.observe(cost, drafting, _result(3), BLOCK)  # verifies drafts: the speculator's
    assert len(late) == 0
    for step_id in (4, 5, 6):
        late.observe(cost, _chunk(step_id, 0, 32), _result(step_id), BLOCK)
    assert len(late) == 2  # the oldest forgotten
    late.observe(cost, _chunk(7, 0, 1), _result(7, 0.001, [_timed(4, 0.1), _timed(5, 0.2)]), BLOCK)
    assert [seen[2] for seen in cost.seen] == [0.2]  # not step 4 (forgotten), nor 7 (after timed step 6)
    late.observe(cost, _chunk(10, 0, 1), _result(10, 0.001), BLOCK)
    late.observe(cost, _chunk(11, 0, 1), _result(11, 0.002), BLOCK)
    assert [seen[2] for seen in cost.seen] == [0.2, 0.001]  # measured, after a measured step (once 11 is back)
    late.clear()
    late.observe(cost, _chunk(8, 0, 1), _result(8, 0.001, [_timed(6, 0.3)]), BLOCK)
    assert 0.3 not in [seen[2] for seen in cost.seen]


def test_the_online_model_converges_on_the_gpus_costs() -> None:
    truth = FixedCostModel(a=0.004, b=3e-5, c=2e-4, d=2e-3)
    model, late = OnlineCostModel(), LateTimings()
    previous: StepPlan | None = None
    for step_id in range(300):
        start, tokens = (step_id * 7919) % 30_000, 512 + 97 * (step_id % 41)
        plan = _chunk(step_id, start, tokens)
        timings = [] if previous is None else [_timed(previous.step_id, truth.step_seconds(
            *step_features(previous, BLOCK)))]
        late.observe(model, plan, _result(step_id, timings=timings), BLOCK)
        previous = plan
    assert late.num_observed == 299
    probe = step_features(_chunk(0, 28_000, 2048), BLOCK)
    assert model.step_seconds(*probe) == pytest.approx(truth.step_seconds(*probe), rel=0.02)


def test_a_step_teaches_its_wall_share_not_its_launch_to_read_back() -> None:
    """A deferred step is launched before the previous one is read back: its execute_seconds holds the rest
    of that step (on the H200, two 120 ms steps at 300k of a 1M prompt read 230 ms). What its decodes wait
    between tokens, and what the model learns, is its interval; execute_seconds only where none was sent."""
    cost, late = _Recorder(), LateTimings()
    late.observe(cost, _chunk(1, 300_000, 256), _result(1, 0.230, interval=0.118), BLOCK)
    late.observe(cost, _chunk(2, 300_256, 256), _result(2, 0.120), BLOCK)  # no interval: launch to read-back
    late.observe(cost, _chunk(3, 300_512, 256), _result(3, 0.120, interval=0.117), BLOCK)
    assert [seen[2] for seen in cost.seen] == [0.118, 0.120]


def test_steps_read_back_together_are_taught_as_their_average() -> None:
    """Read-backs in pairs (eager mixed steps of a 1M-token prompt on the H200: 132.8 ms, then 0.2 ms):
    the first step's wall share holds both GPU times, the second's nothing. Taught as one average step."""
    cost, late = _Recorder(), LateTimings()
    late.observe(cost, _chunk(1, 304_079, 142), _result(1, 0.1328, interval=0.1328), BLOCK)
    late.observe(cost, _chunk(2, 304_221, 320), _result(2, 0.1196, interval=0.0002), BLOCK)
    assert len(cost.seen) == 1
    tokens, decodes, seconds, pairs = cost.seen[0]
    assert (tokens, decodes) == (231, 0) and seconds == pytest.approx(0.0665)
    features = [sum(step_features(_chunk(step, start, n), BLOCK)[2:])
                for step, start, n in ((1, 304_079, 142), (2, 304_221, 320))]
    assert pairs == pytest.approx(sum(features) / 2)
    late.observe(cost, _chunk(3, 304_541, 317), _result(3, 0.0638, interval=0.060), BLOCK)
    late.observe(cost, _chunk(4, 304_858, 101), _result(4, 0.0600, interval=0.055), BLOCK)
    assert [seen[2] for seen in cost.seen] == [pytest.approx(0.0665), 0.060]  # 3 alone, 4 held


def test_a_chunk_pays_for_scanning_its_context() -> None:
    """Its attention features: its pairs, and CHUNK_SCAN_TOKENS queries' worth of its context as a feature of
    its own (what the scan costs depends on the kernel: the model learns its coefficient)."""
    assert chunk_scan(0, 512) == 0.0 and chunk_scan(300_000, 0) == 0.0
    assert chunk_scan(300_000, 2) == chunk_scan(300_000, 256) > chunk_pairs(300_000, 2)  # a few tokens scan it all
    features = step_features(_chunk(1, 300_000, 256), BLOCK)
    assert (features.pairs, features.scan) == (chunk_pairs(300_000, 256), chunk_scan(300_000, 256))


def test_the_scan_gets_its_own_coefficient() -> None:
    """Steps of a kernel whose scan is cheap (split over the keys: H200 trace of a 1M-token prompt, the chunks
    with short prompts beside them predicted 20% short when the scan was priced at the pairs' rate): the
    online model learns pairs and scan apart and predicts both kinds of step."""
    truth = FixedCostModel(a=0.004, b=2e-6, c=1e-4, d=3e-4, e=2e-5)
    model = OnlineCostModel()
    shapes = [(start, n, decodes) for start in (0, 100_000, 300_000, 600_000) for n in (64, 512, 2048)
              for decodes in (0, 32, 200)]
    for _ in range(30):
        for start, n, decodes in shapes:
            model.observe(n, decodes, truth.step_seconds(n, decodes, chunk_pairs(start, n), chunk_scan(start, n)),
                          chunk_pairs(start, n), chunk_scan(start, n))
    for start, n, decodes in shapes:
        args = (n, decodes, chunk_pairs(start, n), chunk_scan(start, n))
        assert model.step_seconds(*args) == pytest.approx(truth.step_seconds(*args), rel=0.02)


def _pp_scheduler(cost: _Recorder) -> tuple[Scheduler, list[StepPlan]]:
    config = SchedulerConfig(max_model_len=8192, max_num_seqs=4, max_num_batched_tokens=512,
                             enable_chunked_prefill=True, block_size=BLOCK, num_blocks=600, max_steps_in_flight=64,
                             enable_prefix_caching=False, pipeline_parallel_size=2)
    scheduler = Scheduler(config, cost_model=cost)
    out = scheduler.handle(AddRequest(request_id="long", prompt_token_ids=[1] * 4000,
                                      params=SamplingParams(max_tokens=2), eos_token_ids=[0]))
    return scheduler, [message for message in out.to(KV_CACHE_MANAGER) if isinstance(message, StepPlan)]


def test_the_scheduler_learns_each_chunk_from_its_gpu_time() -> None:
    cost = _Recorder()
    scheduler, plans = _pp_scheduler(cost)
    assert len(plans) > 3
    *chunks, last = plans
    for index, plan in enumerate(chunks):  # each chunk's GPU time comes with the next chunk's result
        timings = [_timed(chunks[index - 1].step_id, 0.01 * index)] if index else []
        scheduler.handle(StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=[], token_ids=[],
                                    gpu_timings=timings))
    assert len(scheduler.late_timings) == 1 and [seen[2] for seen in cost.seen] == [
        pytest.approx(0.01 * index) for index in range(1, len(chunks))]
    assert [seen[0] for seen in cost.seen] == [plan.num_tokens[0] for plan in chunks[:-1]]
    scheduler.handle(StepResult(step_id=last.step_id, req_ids=["long"], token_ids=[5], execute_seconds=0.02,
                                gpu_timings=[_timed(chunks[-1].step_id, 0.5)]))
    # the last chunk's own time holds the chunk before's (timed): only the latter is learnt
    assert [seen[2] for seen in cost.seen[-2:]] == [pytest.approx(0.01 * (len(chunks) - 1)), 0.5]
    assert len(scheduler.late_timings) == 0


def test_a_pipeline_reset_forgets_the_steps_awaiting_their_time() -> None:
    scheduler, plans = _pp_scheduler(_Recorder())
    scheduler.handle(StepResult(step_id=plans[0].step_id, reset=True, req_ids=[], token_ids=[]))
    assert len(scheduler.late_timings) == 1
    scheduler.handle(RecoverPipeline(actor="worker-1", reason="restarted"))
    assert len(scheduler.late_timings) == 0


def test_the_sizer_aims_below_the_target_by_the_recent_overruns() -> None:
    """Mixed steps that ran past their prediction (the step's wall time varies: H200, a 1M-token prompt beside
    200 decodes, wall / predicted p99 1.44) make the model report how far to aim below a p99 target; decode-only
    steps and the first few say nothing."""
    model = OnlineCostModel()
    assert model.overrun() == 1.0
    for k in range(MIN_OVERRUNS * 4):  # the model, taught exact times, then sees one step in five 30% long
        predicted = model.step_seconds(512, 100, chunk_pairs(300_000, 512), chunk_scan(300_000, 512))
        truth = FixedCostModel(a=0.004, b=2e-6, c=1e-4, d=3e-4, e=2e-5)
        seconds = truth.step_seconds(512, 100, chunk_pairs(300_000, 512), chunk_scan(300_000, 512))
        if k >= MIN_OVERRUNS * 2 and k % 5 == 0 and predicted > 0:
            seconds = 1.3 * predicted
        model.observe(512, 100, seconds, chunk_pairs(300_000, 512), chunk_scan(300_000, 512))
        model.observe(0, 100, 0.0141)  # a decode-only step: not a sized one
    assert model.overrun() == pytest.approx(1.3, rel=0.05)
    assert FixedCostModel().overrun() == 1.0
