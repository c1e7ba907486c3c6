"""Scheduling, KV block accounting and stops, driven in-process with a deterministic fake model."""

from __future__ import annotations

import random

import pytest

from tests.support.fake_runner import FakeRunner
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.sampling import SamplingParams


def make_engine(num_blocks: int, block_size: int = 4, budget: int = 64, max_num_seqs: int = 256,
                chunked: bool = True, serialize: bool = True, prefix_caching: bool = True,
                scheduling_policy: str = "fcfs", steps_in_flight: int = 2) -> tuple[InProcessEngine, FakeRunner]:
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size)
    config = EngineConfig(
        model="fake",
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
        max_model_len=512,
        enable_prefix_caching=prefix_caching,
        scheduling_policy=scheduling_policy,
        steps_in_flight=steps_in_flight,
    )
    engine = InProcessEngine(config, serialize=serialize, runner=runner, tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    return engine, runner


def run(engine: InProcessEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, object]:
    for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt}, p))
    finished = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    engine.check_idle_invariants()  # no table left; every block free or idle in the prefix cache
    return finished


def random_prompts(count: int, seed: int = 0, longest: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 97) for _ in range(rng.randint(1, longest))] for _ in range(count)]


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["caching", "no-caching"])
def test_batched_with_preemption_and_chunking_matches_one_at_a_time(prefix_caching: bool) -> None:
    prompts = random_prompts(16)
    params = [SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True) for i in range(16)]
    engine, runner = make_engine(num_blocks=48, block_size=4, budget=40, prefix_caching=prefix_caching)
    finished = run(engine, prompts, params)
    for index, prompt in enumerate(prompts):
        output = finished[str(index)].outputs[0]
        assert output.token_ids == runner.reference(prompt, 10 + index), f"request {index}"
        assert output.finish_reason == "length"
    assert engine.scheduler.stats.num_preemptions > 0
    assert engine.scheduler.stats.num_prefill_chunks > 0


def test_token_budget_and_max_num_seqs_are_respected() -> None:
    prompts = random_prompts(12, seed=1, longest=60)
    params = [SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.0)] * 12
    engine, runner = make_engine(num_blocks=400, budget=32, max_num_seqs=3)
    run(engine, prompts, params)
    assert max(sum(batch.query_lens) for batch in runner.batches) <= 32
    assert max(len(batch.query_lens) for batch in runner.batches) <= 3


def test_without_chunked_prefill_a_prompt_is_never_split() -> None:
    prompts = random_prompts(6, seed=2, longest=60)
    params = [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)] * 6
    engine, runner = make_engine(num_blocks=400, budget=512, chunked=False)
    finished = run(engine, prompts, params)
    assert engine.scheduler.stats.num_prefill_chunks == 0
    for index, prompt in enumerate(prompts):
        assert finished[str(index)].outputs[0].token_ids == runner.reference(prompt, 3)


def test_eos_stop_token_ids_min_tokens_and_ignore_eos() -> None:
    engine, runner = make_engine(num_blocks=200)
    prompt = random_prompts(1, seed=3)[0]
    reference = runner.reference(prompt, 40)
    stop_token = reference[5]
    first = reference.index(stop_token)
    finished = run(engine, [prompt] * 3, [
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_token], min_tokens=first + 1),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    ])
    stopped = finished["0"].outputs[0]
    assert stopped.token_ids == reference[: first + 1]
    assert (stopped.finish_reason, stopped.stop_reason) == ("stop", stop_token)
    # min_tokens masks the stop token on the worker side until enough tokens exist: the output
    # runs past the first occurrence.
    assert len(finished["1"].outputs[0].token_ids) > first + 1
    assert finished["2"].outputs[0].token_ids == reference


def test_eos_ends_a_request_unless_ignored() -> None:
    engine, runner = make_engine(num_blocks=200)
    prompt = random_prompts(1, seed=4)[0]
    reference = runner.reference(prompt, 30)
    runner.model_config.eos_token_ids = [reference[3]]
    engine.frontend.eos_token_ids = [reference[3]]
    finished = run(engine, [prompt, prompt], [
        SamplingParams(max_tokens=30, temperature=0.0),
        SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True),
    ])
    assert finished["0"].outputs[0].token_ids == reference[: reference.index(reference[3]) + 1]
    assert finished["0"].outputs[0].finish_reason == "stop"
    assert finished["0"].outputs[0].stop_reason is None
    assert finished["1"].outputs[0].token_ids == reference


def test_abort_releases_blocks_and_other_requests_go_on() -> None:
    engine, runner = make_engine(num_blocks=200)
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt}, params))
    for _ in range(4):
        engine.step()
    engine.abort("1")
    finished = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    engine.check_idle_invariants()
    assert set(finished) == {"0", "2"}
    assert finished["2"].outputs[0].token_ids == runner.reference(prompts[2], 20)


def record_plans(engine: InProcessEngine) -> list[StepPlan]:
    """Every plan the KV-cache manager is given from now on, as the scheduler sent it."""
    plans: list[StepPlan] = []
    original = engine.kv_cache_manager.assign_blocks

    def spy(plan: StepPlan, events: list | None = None) -> StepPlan:
        plans.append(plan)
        return original(plan, events)

    engine.kv_cache_manager.assign_blocks = spy  # type: ignore[method-assign]
    return plans


def test_plans_carry_deltas_only() -> None:
    engine, _ = make_engine(num_blocks=200, serialize=False)
    plans = record_plans(engine)
    run(engine, [[5, 6, 7, 8, 9]], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    assert len(plans[0].new_requests) == 1
    decode_plans = [plan for plan in plans[1:] if plan.req_ids]
    assert decode_plans and all(not plan.new_requests for plan in decode_plans)
    assert all(plan.num_tokens == [1] for plan in decode_plans)
    assert plans[-1].finished_ids == ["0"] and not plans[-1].req_ids


@pytest.mark.parametrize("prompt_len", [0, 600])
def test_bad_prompt_lengths_raise_before_queueing(prompt_len: int) -> None:
    engine, _ = make_engine(num_blocks=200)
    with pytest.raises(ValueError, match="prompt"):
        engine.prepare("x", {"prompt_token_ids": [1] * prompt_len}, SamplingParams())
    assert not engine.has_unfinished


def test_out_of_vocabulary_token_is_rejected() -> None:
    engine, _ = make_engine(num_blocks=200)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        engine.prepare("x", {"prompt_token_ids": [1, 1000]}, SamplingParams())


def test_a_raw_add_request_with_token_ids_beyond_int32_gets_an_error_and_the_scheduler_goes_on() -> None:
    from vllm_actors.actors.scheduler.scheduler import Scheduler
    from vllm_actors.protocol.messages import AddRequest, RequestUpdates
    from vllm_actors.protocol.names import FRONTEND

    engine, _ = make_engine(num_blocks=50)
    scheduler: Scheduler = engine.scheduler
    params = SamplingParams(max_tokens=2)
    out = scheduler.handle(AddRequest(request_id="bad", prompt_token_ids=[1, 2**40], params=params, eos_token_ids=[0]))
    updates = out.to(FRONTEND)
    assert isinstance(updates[0], RequestUpdates) and "token ids" in (updates[0].updates[0].error or "")
    assert "bad" not in scheduler.requests
