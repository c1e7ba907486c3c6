"""Prefix caching through the engine: hits, sharing, eviction before preemption, events, metrics.

Driven in process with the fake runner, whose "KV cache" holds token ids read back through the
block tables: a block shared wrongly, a hit that skips uncomputed tokens or a cached block
overwritten changes the generated tokens. Invariants (ledger and KV manager each add up and agree)
are checked after every step.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.engine.test_scheduler import make_engine, record_plans
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.block_hash import block_hash
from vllm_actors.protocol.config import SchedulerConfig
from vllm_actors.protocol.events import BlockCached, BlockEvicted, EventBatch, KvPool, Preempted, PrefixHit, Scheduled
from vllm_actors.protocol.messages import AddRequest, StepPlan, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def record_events(engine: InProcessEngine) -> list[Any]:
    events: list[Any] = []

    def listen(batch: EventBatch) -> None:
        events.extend(batch.events)

    engine.event_listeners.append(listen)
    return events


def submit(engine: InProcessEngine, request_id: str, prompt: list[int], max_tokens: int, **params: Any) -> None:
    sampling = SamplingParams(max_tokens=max_tokens, **{**GREEDY, **params})
    engine.submit(engine.prepare(request_id, {"prompt_token_ids": prompt}, sampling))


def drain(engine: InProcessEngine) -> dict[str, list[int]]:
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    engine.check_idle_invariants()
    return finished


def mirror_from_events(events: list[Any]) -> dict[int, int]:
    """What a router outside the engine knows of the cache from the bus: block hash -> parent."""
    mirror: dict[int, int] = {}
    for event in events:
        if isinstance(event, BlockCached):
            parent = event.parent_hash
            assert parent == 0 or parent in mirror, "a block cached under an unknown parent"
            for block_hash_ in event.block_hashes:
                mirror[block_hash_] = parent
                parent = block_hash_
        elif isinstance(event, BlockEvicted):
            for block_hash_, parent in zip(event.block_hashes, event.parent_hashes, strict=True):
                assert mirror.pop(block_hash_) == parent
                assert block_hash_ not in mirror.values(), "a block evicted before its children"
    return mirror


def shared_prefix_prompts(count: int, prefix_len: int, seed: int, tail: tuple[int, int] = (1, 20)) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 97) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, 97) for _ in range(rng.randint(*tail))] for _ in range(count)]


def test_requests_share_the_prefix_the_first_one_computes() -> None:
    engine, runner = make_engine(num_blocks=200, block_size=4, budget=512)
    plans = record_plans(engine)
    events = record_events(engine)
    prompts = shared_prefix_prompts(6, prefix_len=40, seed=1)
    for index, prompt in enumerate(prompts):
        submit(engine, str(index), prompt, 5)
    finished = drain(engine)
    for index, prompt in enumerate(prompts):
        assert finished[str(index)] == runner.reference(prompt, 5)
    hits = {new.request_id: new.num_cached_tokens for plan in plans for new in plan.new_requests}
    # The first request computes the 40 shared tokens (10 blocks) and caches them while its step
    # is planned, so the others - planned while that step is still in flight - hit them.
    assert hits["0"] == 0
    assert all(hits[str(index)] == 40 for index in range(1, 6)), hits
    assert sum(n for plan in plans for n in plan.num_tokens) < sum(len(p) for p in prompts) - 5 * 40 + 6 * 5
    prefix_hits = [event for event in events if isinstance(event, PrefixHit)]
    assert len(prefix_hits) == 5 and all(len(event.block_hashes) == 10 for event in prefix_hits)
    chain = [0]  # anyone can compute the hashes from the tokens: blake2b over (parent, block)
    for start in range(0, 40, 4):
        chain.append(block_hash(chain[-1], prompts[1][start:start + 4]))
    assert prefix_hits[0].block_hashes == chain[1:]
    cached = [event for event in events if isinstance(event, BlockCached) and event.request_id == "0"]
    assert cached[0].parent_hash == 0 and cached[0].block_hashes[:10] == prefix_hits[0].block_hashes
    summary = engine.metrics_store.summary()
    assert summary.prefix_cache_hits == 5 * 40
    assert summary.prefix_cache_queries == sum(len(p) for p in prompts)


def test_a_request_admitted_later_in_the_same_pass_hits_blocks_planned_before_it() -> None:
    config = SchedulerConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=512,
                             enable_chunked_prefill=True, block_size=4, num_blocks=100, max_steps_in_flight=1)
    scheduler = Scheduler(config)
    params = SamplingParams(max_tokens=3, **GREEDY)

    def plans(out: Outputs) -> list[StepPlan]:
        return [m for m in out.to(KV_CACHE_MANAGER) if isinstance(m, StepPlan)]

    def add(request_id: str, prompt: list[int]) -> Outputs:
        return scheduler.handle(AddRequest(request_id=request_id, prompt_token_ids=prompt, params=params,
                                           eos_token_ids=[0]))

    first = plans(add("a", [3] * 10))[0]
    shared = list(range(1, 25))
    assert not plans(add("b", shared + [30]))  # one step in flight
    add("c", shared + [31, 32])
    out = scheduler.handle(StepResult(step_id=first.step_id, reset=first.reset, req_ids=["a"], token_ids=[5]))
    plan = plans(out)[0]
    hits = {new.request_id: new.num_cached_tokens for new in plan.new_requests}
    assert hits == {"b": 0, "c": 24}
    c = plan.req_ids.index("c")
    assert len(plan.cached_hashes["b"]) == 6 and "c" not in plan.cached_hashes  # c's 6 full blocks are b's
    assert plan.num_tokens[c] == 2


def test_a_later_request_hits_the_blocks_a_finished_one_left_cached() -> None:
    engine, runner = make_engine(num_blocks=200, block_size=4)
    prompts = shared_prefix_prompts(2, prefix_len=33, seed=2)
    submit(engine, "a", prompts[0], 6)
    drain(engine)
    plans = record_plans(engine)
    submit(engine, "b", prompts[1], 6)
    assert drain(engine)["b"] == runner.reference(prompts[1], 6)
    assert plans[0].new_requests[0].num_cached_tokens == 32  # 8 full blocks of the 33 shared


def test_output_blocks_are_cached_so_the_next_turn_hits_the_reply() -> None:
    engine, runner = make_engine(num_blocks=200, block_size=4)
    prompt = shared_prefix_prompts(1, prefix_len=10, seed=3, tail=(0, 0))[0]
    submit(engine, "turn1", prompt, 20)
    reply = drain(engine)["turn1"]
    plans = record_plans(engine)
    history = prompt + reply + [7, 8, 9]
    submit(engine, "turn2", history, 5)
    assert drain(engine)["turn2"] == runner.reference(history, 5)
    # The first turn's KV covers prompt + reply minus the last sampled token (never an input).
    computed = len(prompt) + len(reply) - 1
    assert plans[0].new_requests[0].num_cached_tokens == computed // 4 * 4


def test_the_last_partial_block_and_identical_prompts_are_never_written_twice() -> None:
    engine, runner = make_engine(num_blocks=200, block_size=4)
    plans = record_plans(engine)
    prompt = shared_prefix_prompts(1, prefix_len=16, seed=4, tail=(0, 0))[0]
    for index in range(3):
        submit(engine, str(index), prompt, 8)
    finished = drain(engine)
    assert all(tokens == runner.reference(prompt, 8) for tokens in finished.values())
    # A whole-block prompt leaves its last block to compute: a step must produce logits.
    hits = [new.num_cached_tokens for plan in plans for new in plan.new_requests]
    assert hits == [0, 12, 12]


def test_idle_cached_blocks_are_evicted_before_anyone_is_preempted() -> None:
    engine, runner = make_engine(num_blocks=24, block_size=4, budget=256)
    events = record_events(engine)
    rng = random.Random(5)
    old = [[rng.randrange(1, 97) for _ in range(40)] for _ in range(2)]
    for index, prompt in enumerate(old):
        submit(engine, f"old{index}", prompt, 2)
        drain(engine)
    assert engine.scheduler.ledger.num_cached == 20  # both prompts' blocks stay cached, idle
    fresh = [rng.randrange(1, 97) for _ in range(60)]
    submit(engine, "fresh", fresh, 4)
    assert drain(engine)["fresh"] == runner.reference(fresh, 4)
    evicted = [event for event in events if isinstance(event, BlockEvicted)]
    assert sum(len(event.block_ids) for event in evicted) >= 16 - 4
    assert not any(isinstance(event, Preempted) for event in events)
    # Least recently used first: old0's blocks went before old1's, leaves (its tail) first.
    first = evicted[0]
    cached_old0 = [e for e in events if isinstance(e, BlockCached) and e.request_id == "old0"]
    old0_hashes = [h for e in cached_old0 for h in e.block_hashes]
    assert first.block_hashes[0] == old0_hashes[-1]
    assert first.parent_hashes[0] == old0_hashes[-2]


def test_a_recently_used_prefix_survives_eviction() -> None:
    engine, runner = make_engine(num_blocks=24, block_size=4, budget=256)
    rng = random.Random(6)
    a, b = ([rng.randrange(1, 97) for _ in range(40)] for _ in range(2))
    submit(engine, "a", a, 2)
    drain(engine)
    submit(engine, "b", b, 2)
    drain(engine)
    submit(engine, "a-again", a + [5], 2)  # touches a's blocks: b is now the older one
    drain(engine)
    plans = record_plans(engine)
    submit(engine, "c", [rng.randrange(1, 97) for _ in range(30)], 2)
    drain(engine)
    submit(engine, "a-third", a + [6], 2)
    drain(engine)
    hits = [new.num_cached_tokens for plan in plans for new in plan.new_requests]
    assert hits[-1] == 40, hits


@pytest.mark.parametrize("seed", [7, 8, 9])
def test_greedy_outputs_are_identical_with_caching_on_and_off_under_eviction_and_preemption(seed: int) -> None:
    """Conversations and shared system prompts through a pool too small for them: blocks are
    evicted and requests preempted mid-run; every step's invariants hold; outputs match the
    one-at-a-time reference and caching off."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 97) for _ in range(rng.randint(20, 60))] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(1, 97) for _ in range(rng.randint(1, 30))] for _ in range(24)]
    max_tokens = [rng.randint(4, 30) for _ in prompts]
    results = {}
    for caching in (True, False):
        engine, runner = make_engine(num_blocks=60, block_size=4, budget=48, prefix_caching=caching)
        events = record_events(engine)
        for index, prompt in enumerate(prompts):
            submit(engine, str(index), prompt, max_tokens[index])
        results[caching] = drain(engine)
        for index, prompt in enumerate(prompts):
            assert results[caching][str(index)] == runner.reference(prompt, max_tokens[index]), (caching, index)
        if caching:
            assert mirror_from_events(events) == {
                block_hash_: entry.parent_hash for block_hash_, entry in engine.kv_cache_manager.cached.items()
            }
            assert any(isinstance(event, PrefixHit) for event in events)
            assert any(isinstance(event, BlockEvicted) for event in events)
            assert engine.scheduler.stats.num_preemptions > 0
        else:
            assert not any(isinstance(event, (PrefixHit, BlockCached, BlockEvicted)) for event in events)
    assert results[True] == results[False]


def test_prompt_logprobs_requests_compute_their_whole_prompt() -> None:
    engine, runner = make_engine(num_blocks=200, block_size=4)
    events = record_events(engine)
    prompt = shared_prefix_prompts(1, prefix_len=20, seed=10, tail=(3, 3))[0]
    submit(engine, "warm", prompt, 2)
    drain(engine)
    submit(engine, "logprobs", prompt, 2, prompt_logprobs=1)
    drain(engine)
    scheduled = [e for e in events if isinstance(e, Scheduled) and e.request_id == "logprobs"]
    assert (scheduled[0].num_query_tokens, scheduled[0].num_cached_tokens) == (0, 0)


def test_longest_prefix_first_admits_the_cached_request_before_an_older_one() -> None:
    order: dict[str, list[str]] = {}
    for policy in ("fcfs", "lpm"):
        engine, runner = make_engine(num_blocks=200, block_size=4, max_num_seqs=1, scheduling_policy=policy)
        events = record_events(engine)
        rng = random.Random(11)
        shared = [rng.randrange(1, 97) for _ in range(40)]
        submit(engine, "first", shared + [1], 3)
        engine.step()  # "first" runs; the other two wait behind max_num_seqs=1
        submit(engine, "older", [rng.randrange(1, 97) for _ in range(40)], 3)
        submit(engine, "cached", shared + [2], 3)
        drain(engine)
        order[policy] = [e.request_id for e in events if isinstance(e, Scheduled)]
    assert order["fcfs"] == ["first", "older", "cached"]
    assert order["lpm"] == ["first", "cached", "older"]


def test_kv_pool_events_count_idle_cached_blocks_as_not_in_use() -> None:
    engine, _ = make_engine(num_blocks=50, block_size=4)
    events = record_events(engine)
    submit(engine, "a", list(range(1, 30)), 3)
    drain(engine)
    last = [event for event in events if isinstance(event, KvPool)][-1]
    assert last.num_in_use == 0 and last.num_cached == 7 and last.num_cached_idle == 7
    assert last.num_free + last.num_cached == last.num_blocks
    summary = engine.metrics_store.summary()
    assert (summary.kv_blocks_in_use, summary.kv_blocks_total, summary.kv_blocks_cached) == (0, 50, 7)


def test_kv_manager_rejects_a_hit_on_blocks_evicted_by_an_earlier_plan() -> None:
    """Regression: the KV manager's memo of hit chains must not outlive an eviction made by a
    plan without new requests (the hit would pass the check, then fail half-applied)."""
    from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
    from vllm_actors.protocol.block_hash import block_hash
    from vllm_actors.protocol.messages import NewRequest
    from vllm_actors.protocol.token_ids import pack_token_ids

    manager = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(1, 10))  # two full blocks and one token
    first = block_hash(0, tokens[:4])
    second = block_hash(first, tokens[4:8])
    params = SamplingParams(max_tokens=1)

    def new(request_id: str, cached: int, last: int) -> NewRequest:
        return NewRequest(request_id=request_id, token_ids=pack_token_ids(tokens), num_prompt_tokens=9,
                          num_output_tokens=0, params=params, eos_token_ids=[0], num_cached_tokens=cached,
                          cached_block_hash=last)

    plans = [
        StepPlan(step_id=0, new_requests=[new("a", 0, 0)], req_ids=["a"], num_tokens=[9], num_blocks=[3],
                 cached_hashes={"a": [first, second]}),
        StepPlan(step_id=1, new_requests=[new("b", 8, second)], finished_ids=["a"], req_ids=["b"],
                 num_tokens=[1], num_blocks=[3]),
        StepPlan(step_id=2, finished_ids=["b"], evicted_hashes=[second, first]),
    ]
    for plan in plans:
        manager.assign_blocks(plan)
        manager.check_invariants()
    stale = StepPlan(step_id=3, new_requests=[new("c", 8, second)], req_ids=["c"], num_tokens=[1],
                     num_blocks=[3])
    with pytest.raises(ValueError, match="not cached"):
        manager.assign_blocks(stale)
    manager.check_invariants()
    assert not manager.block_tables and manager.num_free_blocks == 8
