"""Every state transition is an event: complete, in lifecycle order, no sequence gaps (in-process)."""

from __future__ import annotations

import pytest

from tests.engine.test_scheduler import make_engine, random_prompts
from tests.support.fake_runner import FakeRunner
from tests.support.lifecycle import check_against_outputs, check_sequences, check_story, request_stories
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.observe.tap_format import EVENT_GROUPS
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import EventBatch, event_type
from vllm_actors.protocol.sampling import SamplingParams


def test_events_tell_every_request_story() -> None:
    runner = FakeRunner(num_blocks=48, block_size=4)
    config = EngineConfig(model="fake", block_size=4, max_num_batched_tokens=40, max_model_len=512)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    batches: list[EventBatch] = []
    engine.event_listeners.append(batches.append)
    prompts = random_prompts(12, seed=9)
    for index, prompt in enumerate(prompts):
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt},
                                     SamplingParams(max_tokens=8 + index, temperature=0.0, ignore_eos=True)))
    engine.step()
    engine.step()
    engine.abort("3")
    finished = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    engine.run_until_idle()

    counts = check_sequences(batches)
    assert set(counts) == {"frontend", "scheduler", "kv_cache_manager", "worker"}
    kinds = {event_type(event) for batch in batches for event in batch.events}
    assert {"ARRIVED", "QUEUED", "SCHEDULED", "PREFILL_CHUNK", "FIRST_TOKEN", "TOKENS", "PREEMPTED", "RESUMED",
            "FINISHED", "ABORTED", "ALLOCATED", "FREED", "STEP_STARTED", "STEP_FINISHED"} <= kinds
    stories = request_stories(batches)
    assert set(stories) == {str(i) for i in range(12)}
    for request_id, story in stories.items():
        check_story(request_id, story)
    check_against_outputs(stories, list(finished.values()))
    assert [kind for kind, _ in stories["3"] if kind not in EVENT_GROUPS["KV"]][-1] == "ABORTED"
    # One batch per actor per handling: the scheduler never publishes more batches than it handled messages.
    worker_batches = [batch for batch in batches if batch.actor == "worker"]
    assert all(len(batch.events) == 2 for batch in worker_batches)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_iteration_tokens_count_as_vllms(prefix_caching: bool) -> None:
    """vLLM's ``vllm:iteration_tokens_total`` (tests/entrypoints/openai/test_metrics.py): 10 requests
    one after another of one 33-token prompt, max_tokens 10. Each step sampling tokens is observed
    once, with its sampled tokens (a request's first included) plus the prompt tokens of the requests
    it sampled a first token for that were computed, not found in the prefix cache."""
    engine, _ = make_engine(num_blocks=64, block_size=16, prefix_caching=prefix_caching)
    prompt = list(range(1, 34))
    for index in range(10):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        engine.submit(engine.prepare(str(index), {"prompt_token_ids": prompt}, params))
        engine.run_until_idle()
    summary = engine.metrics_store.summary()
    histogram = summary.step_tokens_histogram
    assert histogram.count == 10 * 10  # a step per generated token
    # without the prefix cache every prompt is computed: vLLM's expected 10 * (33 + 10)
    computed = 10 * 33 if not prefix_caching else 33 + 9 * (33 - 32)  # two blocks of 16 found cached
    assert summary.prompt_tokens_computed == computed
    assert histogram.total == computed + 10 * 10
    assert histogram.total == (430 if not prefix_caching else 142)
