"""Every state transition is an event: complete, in lifecycle order, no sequence gaps (in-process)."""

from __future__ import annotations

from tests.engine.test_scheduler import random_prompts
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
