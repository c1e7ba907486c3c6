"""No table grows with the number of requests served, under abusive load.

8,000 requests go through the in-process engine (the same state machines as the processes, on
the in-memory transport): plain ones, n=2 ones, client disconnects mid-generation, long ids,
resubmissions and raw ``AddRequest``s the scheduler refuses, with preemptions on a small KV pool
and prefix caching on. Every container of every actor (found by walking its attributes, so a
table added later is covered too) is measured after the first 1,000 and after all 8,000: none
may have grown, beyond what the KV pool bounds. The scheduler shell's ``RequestOwners`` sees the
same traffic. The prefix cache holds at most the pool's blocks, and evicted tree nodes are freed.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.actors.scheduler import prefix_cache
from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.messages import AbortRequests, AddRequest, RequestUpdates
from vllm_actors.protocol.names import FRONTEND, MAX_REQUEST_ID_LENGTH, SCHEDULER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams

NUM_BLOCKS = 96
BLOCK_SIZE = 4
WAVE = 250


def make_engine() -> tuple[InProcessEngine, RequestOwners]:
    runner = FakeRunner(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    config = EngineConfig(model="fake", block_size=BLOCK_SIZE, max_num_batched_tokens=256, max_num_seqs=64,
                          max_model_len=128, enable_prefix_caching=True)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    replies = RequestOwners()
    scheduler = engine.scheduler
    handle = scheduler.handle

    def observed(message: Any) -> Outputs:  # as the scheduler's shell does
        outputs = handle(message)
        replies.observe(b"client", message)
        for output in outputs.to(FRONTEND):
            if isinstance(output, RequestUpdates):
                replies.split(output)
        return outputs

    scheduler.handle = observed  # type: ignore[method-assign]
    return engine, replies


def run_wave(engine: InProcessEngine, start: int, rng: random.Random) -> None:
    shared = [rng.randrange(1, 97) for _ in range(3 * BLOCK_SIZE)]  # a system prompt, for cache hits
    ids: list[str] = []
    for index in range(start, start + WAVE):
        kind = index % 10
        prompt = (shared if kind < 4 else []) + [rng.randrange(1, 97) for _ in range(rng.randint(1, 40))]
        request_id = f"r{index}" if kind != 5 else f"long-{index}-".ljust(MAX_REQUEST_ID_LENGTH, "x")
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=kind != 6,
                                n=2 if kind == 7 else 1)
        engine.submit(engine.prepare(request_id, {"prompt_token_ids": prompt}, params))
        ids.append(request_id)
        if kind == 8:  # refused by the scheduler: too long; then one it already holds, resubmitted
            engine.inject(SCHEDULER, AddRequest(request_id=f"raw-{index}", prompt_token_ids=[1] * 500,
                                                params=SamplingParams(), eos_token_ids=[0]))
            engine.inject(SCHEDULER, AddRequest(request_id=request_id, prompt_token_ids=prompt, params=params,
                                                eos_token_ids=[0], resume=True))
    for _ in range(3):
        engine.step()
    for request_id in ids[3::5]:  # clients gone mid-generation
        engine.abort(request_id, reason="disconnect")
    engine.inject(SCHEDULER, AbortRequests(request_ids=[f"never-{start}"], reason="abort"))
    while engine.has_unfinished:
        engine.step()
    engine.run_until_idle()


def containers(obj: Any, path: str, depth: int = 0, seen: set[int] | None = None) -> Iterator[tuple[str, int]]:
    """(attribute path, length) of every container reachable through attributes (depth 4)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return
    seen.add(id(obj))
    attributes = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            attributes[slot] = getattr(obj, slot)
    for name, value in attributes.items():
        if isinstance(value, (str, bytes, int, float, bool)) or value is None or callable(value):
            continue
        if isinstance(value, (dict, list, set, tuple, frozenset)) or type(value).__name__ == "deque":
            yield f"{path}.{name}", len(value)
        elif hasattr(value, "__dict__") or hasattr(type(value), "__slots__"):
            yield from containers(value, f"{path}.{name}", depth + 1, seen)


def sizes(engine: InProcessEngine) -> dict[str, int]:
    found: dict[str, int] = {}
    for name in ("scheduler", "kv_cache_manager", "frontend"):
        found.update(containers(getattr(engine, name), name))
    worker = engine.worker
    found.update((path, size) for path, size in containers(worker, "worker") if ".runner" not in path)
    return found


@pytest.fixture(scope="module")
def served() -> tuple[InProcessEngine, RequestOwners, dict[str, int], dict[str, int]]:
    engine, replies = make_engine()
    rng = random.Random(13)
    for start in range(0, 1_000, WAVE):
        run_wave(engine, start, rng)
    early = sizes(engine)
    for start in range(1_000, 8_000, WAVE):
        run_wave(engine, start, rng)
    return engine, replies, early, sizes(engine)


def test_no_engine_table_grows_with_the_requests_served(
        served: tuple[InProcessEngine, RequestOwners, dict[str, int], dict[str, int]]) -> None:
    engine, replies, early, late = served
    grown = {path: (early.get(path), size) for path, size in late.items()
             if size > max(early.get(path, 0), 2 * NUM_BLOCKS + 64)}
    assert not grown, f"grew from 1,000 to 8,000 requests: {grown}"
    scheduler = engine.scheduler
    assert not (scheduler.requests or scheduler.waiting or scheduler.running or scheduler.departed)
    assert not scheduler.ledger._holdings and not engine.kv_cache_manager.block_tables
    assert not engine.worker.requests
    assert not replies._owner, f"{len(replies._owner)} requests still have an owner"
    engine.check_idle_invariants()


def test_the_prefix_cache_is_bounded_by_the_pool_and_frees_evicted_nodes(
        served: tuple[InProcessEngine, RequestOwners, dict[str, int], dict[str, int]]) -> None:
    engine = served[0]
    cache = engine.scheduler.ledger.cache
    assert cache is not None
    assert 0 < cache.num_cached <= NUM_BLOCKS
    assert len(cache._heap) <= 2 * cache.num_cached + 64
    gc.collect()
    nodes = sum(type(obj) is prefix_cache._Node for obj in gc.get_objects())
    # The tree (and its root), plus at most the stale heap entries and the last match's path.
    assert nodes <= 1 + cache.num_cached + len(cache._heap) + len(cache._last_match[1])


def test_the_metrics_store_tables_stay_within_their_bounds(
        served: tuple[InProcessEngine, RequestOwners, dict[str, int], dict[str, int]]) -> None:
    store: MetricsStore = served[0].metrics_store
    tables = store.table_sizes()
    assert tables["history"] <= store.max_events
    assert tables["ended"] <= store.max_finished_requests and tables["open"] == 0
    assert tables["children"] <= tables["ended"]
    assert tables["running"] == tables["waiting"] == tables["kv_blocks"] == 0
    assert store.retained_bytes <= (64 << 20) * 2
    requests = store._recorder.requests
    assert requests.nbytes == sum(r.nbytes for r in [*requests.open.values(), *requests.ended.values()])
