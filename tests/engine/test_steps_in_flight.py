"""The scheduler keeps ``max_steps_in_flight`` plans out, also for a lone request.

It used to make at most one plan per message it handled. A lone request then never had a second
step in flight: its prefill's plan went out with the AddRequest, and from there each result
released exactly one plan. At batch 1 every token waited for a whole control-loop round trip
(result to the scheduler, plan to the KV-cache manager, plan to the worker) with the GPU idle:
10% of a TP=2 decode step of a Qwen3-8B-shaped model on two H100s, found in a step profile.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine.test_scheduler import make_engine, random_prompts, record_plans, run
from tests.support.scheduler_messages import add, plans_of, result_of, updates_of
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.sampling import SamplingParams


def scheduler(depth: int, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=8, max_num_batched_tokens=budget, block_size=4,
                                     num_blocks=100, max_steps_in_flight=depth, enable_chunked_prefill=True))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_a_lone_request_has_depth_steps_in_flight_from_its_first_message_to_its_last_token(depth: int) -> None:
    s = scheduler(depth)
    plans: list[Any] = plans_of(s.handle(add("a", [1, 2, 3], max_tokens=6)))
    assert len(plans) == depth  # the prefill, then decodes of tokens still in flight
    assert [plan.num_tokens for plan in plans] == [[3]] + [[1]] * (depth - 1)
    tokens: list[int] = []
    while plans:
        oldest = plans.pop(0)
        out = s.handle(result_of(oldest, token=10 + len(tokens)))
        tokens += [t for update in updates_of(out) for t in update.new_token_ids]
        new = [plan for plan in plans_of(out) if plan.req_ids]  # not the last one, which only frees "a"
        # Each result releases one plan until the tokens in flight reach max_tokens.
        assert len(new) == (1 if len(tokens) + len(plans) < 6 else 0)
        plans += new
        assert len(plans) <= depth
    assert tokens == [10, 11, 12, 13, 14, 15] and not s.requests


def test_a_long_prompt_sends_its_chunks_back_to_back() -> None:
    s = scheduler(2, budget=32)
    first, second = plans_of(s.handle(add("a", list(range(1, 51)), max_tokens=2)))
    assert (first.num_tokens, second.num_tokens) == ([32], [18])  # the second chunk does not wait


def test_outputs_with_two_steps_in_flight_equal_one_step_at_a_time() -> None:
    prompts = random_prompts(10, seed=5, longest=40)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True) for i in range(10)]
    outputs = {}
    for depth in (1, 2):
        engine, runner = make_engine(num_blocks=40, block_size=4, budget=24, steps_in_flight=depth)
        assert engine.scheduler.config.max_steps_in_flight == depth
        plans = record_plans(engine)
        finished = run(engine, prompts, params)
        outputs[depth] = {key: output.outputs[0].token_ids for key, output in finished.items()}
        for index, prompt in enumerate(prompts):
            assert outputs[depth][str(index)] == runner.reference(prompt, 3 + index)
        assert plans
    assert outputs[1] == outputs[2]
