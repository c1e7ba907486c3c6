"""The host KV tier through the engine, in process with the fake runner (whose "KV cache" holds
token ids: a block restored from the wrong slot, or not copied out before its GPU block was
reused, changes the generated tokens). Invariants, and the scheduler's and the KV-cache manager's
agreement on which blocks the host holds, are checked after every step."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.engine.test_engine_prefix_caching import drain, mirror_from_events, record_events, submit
from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.block_runs import num_blocks as run_blocks
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import BlockEvicted, BlockOffloaded, BlockRestored, PrefillChunk, Resumed, Scheduled


def make_engine(num_blocks: int, num_host_blocks: int, block_size: int = 4, budget: int = 64,
                prefix_caching: bool = True) -> tuple[InProcessEngine, FakeRunner]:
    runner = FakeRunner(num_blocks=num_blocks, block_size=block_size, num_host_blocks=num_host_blocks)
    config = EngineConfig(model="fake", block_size=block_size, max_num_batched_tokens=budget, max_model_len=512,
                          enable_prefix_caching=prefix_caching)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    return engine, runner


def cached_tokens(events: list[Any], request_id: str) -> int:
    """Prompt tokens the request did not compute at admission (a hit, on the GPU or restored)."""
    return next(event.num_cached_tokens for event in events if isinstance(event, Scheduled)
                and event.request_id == request_id)


def test_an_evicted_prefix_comes_back_from_the_host_tier_instead_of_being_recomputed() -> None:
    engine, runner = make_engine(num_blocks=16, num_host_blocks=32)
    events = record_events(engine)
    rng = random.Random(1)
    prefix = [rng.randrange(1, 97) for _ in range(40)]  # 10 blocks
    submit(engine, "a", prefix + [5, 6], max_tokens=2)
    drain(engine)
    submit(engine, "b", [rng.randrange(1, 97) for _ in range(60)], max_tokens=2)  # pushes all of a's blocks out
    drain(engine)
    offloaded = sum(event.num_blocks for event in events if isinstance(event, BlockOffloaded))
    assert offloaded >= 10 and not any(isinstance(event, BlockEvicted) for event in events)
    assert runner.host_tier is not None and runner.host_tier.num_offloaded == offloaded
    submit(engine, "c", prefix + [7, 8, 9], max_tokens=4)
    finished = drain(engine)
    assert finished["c"] == runner.reference(prefix + [7, 8, 9], 4)
    restored = [event for event in events if isinstance(event, BlockRestored)]
    assert sum(event.num_blocks for event in restored) == 10
    assert sum(run_blocks(event.copies) for event in restored) == 10
    assert len(restored[-1].copies) < 3 * 10, "consecutive blocks travel as runs"
    assert cached_tokens(events, "c") == 40, "the prefix was restored, only the tail computed"


def test_the_host_tier_is_bounded_and_drops_its_oldest_blocks_first() -> None:
    engine, runner = make_engine(num_blocks=12, num_host_blocks=6)
    events = record_events(engine)
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 97) for _ in range(33)] for _ in range(4)]  # 8 full blocks each
    for index, prompt in enumerate(prompts):
        submit(engine, str(index), prompt, max_tokens=1)
        drain(engine)
        assert len(engine.scheduler.ledger.host or ()) <= 6
    # A plan evicting more than fits drops its first (deepest) blocks at once (tier "gpu": they
    # never reach the host); later the oldest host blocks go (tier "host").
    assert any(isinstance(event, BlockEvicted) and event.tier == "host" for event in events)
    ledger = engine.scheduler.ledger
    assert ledger.host is not None and ledger.cache is not None
    cached = {ledger.cache.block_hash_of(label) for label in ledger.cache.cached_block_ids()}
    assert set(mirror_from_events(events)) == cached | set(ledger.host.blocks), "a mirror keeps host blocks cached"
    # the third prompt's blocks are on the GPU or the newest on the host: all come back
    submit(engine, "again-2", prompts[2] + [1], max_tokens=2)
    submit(engine, "again-0", prompts[0] + [1], max_tokens=2)
    finished = drain(engine)
    assert finished["again-2"] == runner.reference(prompts[2] + [1], 2)
    assert finished["again-0"] == runner.reference(prompts[0] + [1], 2)
    assert cached_tokens(events, "again-2") == 8 * 4
    assert any(isinstance(event, BlockRestored) for event in events)
    assert cached_tokens(events, "again-0") == 0, "the oldest blocks were dropped from the host"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_outputs_are_identical_with_and_without_the_host_tier(seed: int) -> None:
    """Shared prefixes, a pool small enough to evict and preempt, a host tier smaller than the
    evictions: every output matches greedy decoding alone and runs without the tier."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 97) for _ in range(rng.randint(8, 40))] for _ in range(4)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1, 97) for _ in range(rng.randint(1, 9))] for _ in range(24)]
    lengths = [rng.randint(1, 8) for _ in prompts]
    results = []
    for host_blocks in (0, 10):
        engine, runner = make_engine(num_blocks=24, num_host_blocks=host_blocks, budget=32)
        events = record_events(engine)
        finished: dict[str, list[int]] = {}
        for wave in range(0, len(prompts), 6):
            for index in range(wave, wave + 6):
                submit(engine, str(index), prompts[index], max_tokens=lengths[index])
            finished.update(drain(engine))
        results.append(finished)
        for index, prompt in enumerate(prompts):
            assert finished[str(index)] == runner.reference(prompt, lengths[index])
        if host_blocks:
            assert any(isinstance(event, BlockRestored) for event in events)
            assert runner.host_tier is not None
            assert all(fence <= launched for launched, fence in runner.host_tier.fences)
            assert any(fence > 0 for _, fence in runner.host_tier.fences), "blocks released by leaving requests fence"
            assert any(fence < launched for launched, fence in runner.host_tier.fences), "no copy overlapped a step"
    assert results[0] == results[1]


def test_a_real_model_restores_an_evicted_prefix_with_identical_greedy_output(tiny_qwen3: Path) -> None:
    """The real model runner on a tiny model: a prefix pushed out of an 8-block pool between two
    requests sharing it comes back from host memory (restored, not recomputed) and the second
    request's greedy tokens are those of a run without the host tier."""
    rng = random.Random(5)
    prefix = [rng.randrange(1, 500) for _ in range(80)]  # 5 blocks of 16
    prompts = [prefix + [rng.randrange(1, 500) for _ in range(5)], [rng.randrange(1, 500) for _ in range(100)],
               prefix + [rng.randrange(1, 500) for _ in range(7)]]
    outputs: dict[float, dict[str, list[int]]] = {}
    for offload_gb in (0.0, 0.01):
        config = EngineConfig(model=str(tiny_qwen3), dtype="float32", block_size=16, num_gpu_blocks_override=8,
                              max_num_batched_tokens=128, kv_cache_offload_gb=offload_gb, seed=0)
        engine = InProcessEngine(config, serialize=True, tokenizer=None)
        engine.step_hooks.append(lambda e: e.check_invariants())
        events = record_events(engine)
        outputs[offload_gb] = {}
        for index, prompt in enumerate(prompts):  # one after the other: each evicts the one before
            submit(engine, str(index), prompt, max_tokens=4)
            outputs[offload_gb].update(drain(engine))
        restored = sum(event.num_blocks for event in events if isinstance(event, BlockRestored))
        hit = cached_tokens(events, "2")
        if offload_gb:
            assert restored > 0 and hit == 80, "the prefix came back from the host, not recomputed"
        else:
            assert restored == 0 and hit < 80, "the pool was meant to evict the prefix"
    assert outputs[0.01] == outputs[0.0]


def restart_worker(engine: InProcessEngine, runner: FakeRunner, host: str) -> FakeRunner:
    """A fresh worker on a runner whose "GPU" holds garbage; ``host`` "kept": the host tier's memory
    outlived the old worker (the supervisor's shared file), "garbage": it did not."""
    from tests.support.recovery_runs import recover
    from vllm_actors.actors.worker.worker import Worker
    from vllm_actors.protocol.names import WORKER
    from vllm_actors.runner.sampler import Sampler

    assert runner.host_tier is not None
    fresh = FakeRunner(num_blocks=runner.num_blocks, block_size=runner.block_size,
                       num_host_blocks=runner.host_tier.num_blocks)
    rng = random.Random(9)
    fresh.slots = [rng.randrange(97) for _ in fresh.slots]
    assert fresh.host_tier is not None
    fresh.host_tier.slots = (list(runner.host_tier.slots) if host == "kept"
                             else [rng.randrange(97) for _ in fresh.host_tier.slots])
    engine.replace_actor(Worker(fresh, Sampler(fresh.device, 0), clock=time.perf_counter, host_tier=fresh.host_tier))
    recover(engine, WORKER, first=False)
    return fresh


@pytest.mark.parametrize("host", ["kept", "garbage"])
def test_a_restarted_worker_resumes_a_long_prompt_from_the_host_tier(host: str) -> None:
    """A long prompt's blocks are written through to the host tier as its chunks are computed; the
    worker dies mid-prefill (its "GPU" garbage). With the host memory kept, the resumed request
    restores the blocks known complete and recomputes only the rest; every output is the greedy
    reference (a restore from the wrong slot, or of a copy not made, would change it). With the
    host memory lost too, the output would differ: the tokens come from the host copy."""
    engine, runner = make_engine(num_blocks=48, num_host_blocks=48, budget=16)
    scheduler = engine.scheduler
    scheduler.config = msgspec.structs.replace(scheduler.config, host_write_through_tokens=64)
    scheduler.ledger.write_through_tokens = 64
    events = record_events(engine)
    rng = random.Random(4)
    prompt = [rng.randrange(1, 97) for _ in range(120)]  # 30 blocks of 4, 8 chunks of 16
    submit(engine, "long", prompt, max_tokens=4)
    while sum(1 for event in events if isinstance(event, PrefillChunk)) < 5:
        engine.step()
    written = sum(event.num_blocks for event in events if isinstance(event, BlockOffloaded) and event.write_through)
    assert written >= 12, "the computed chunks' blocks were written through"
    fresh = restart_worker(engine, runner, host)
    finished = drain(engine)
    resumed = next(event for event in events if isinstance(event, Resumed) and event.request_id == "long")
    restored = sum(event.num_blocks for event in events if isinstance(event, BlockRestored))
    assert 0 < restored * 4 == resumed.num_cached_tokens < len(prompt), "fewer tokens recomputed than the prompt"
    assert restored <= written - 4, "the copies of the last two steps' plans were not trusted"
    assert fresh.host_tier is not None and fresh.host_tier.num_restored == restored
    if host == "kept":
        assert finished["long"] == runner.reference(prompt, 4)
    else:
        assert finished["long"] != runner.reference(prompt, 4)


def test_a_restarted_kv_cache_manager_takes_the_host_tier_with_it() -> None:
    """Only a worker's restart keeps the host tier: after the KV-cache manager's, whose bookkeeping
    of the slots is gone, the request is recomputed whole."""
    engine, runner = make_engine(num_blocks=48, num_host_blocks=48, budget=16)
    engine.scheduler.ledger.write_through_tokens = 64
    events = record_events(engine)
    prompt = [random.Random(4).randrange(1, 97) for _ in range(120)]
    submit(engine, "long", prompt, max_tokens=4)
    while sum(1 for event in events if isinstance(event, PrefillChunk)) < 5:
        engine.step()
    old = engine.kv_cache_manager
    engine.replace_actor(KVCacheManager(old.pool.num_blocks, old.block_size, old.host.num_slots))
    from tests.support.recovery_runs import recover
    from vllm_actors.protocol.names import KV_CACHE_MANAGER

    recover(engine, KV_CACHE_MANAGER, first=False)
    finished = drain(engine)
    assert finished["long"] == runner.reference(prompt, 4)
    resumed = next(event for event in events if isinstance(event, Resumed) and event.request_id == "long")
    assert resumed.num_cached_tokens == 0 and not any(isinstance(event, BlockRestored) for event in events)
