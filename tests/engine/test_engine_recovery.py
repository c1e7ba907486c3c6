"""Recovery inside the state machines ("let it crash"), driven in process.

An actor of the step pipeline is replaced by a fresh one in the middle of a run, as the supervisor
restarts a crashed process (the messages queued for it die with it), and recovered as in a group:
``RecoverPipeline`` to the scheduler after a KV-cache manager or worker restart; the client's
resubmissions (``AddRequest.resume`` with the tokens it received) after a scheduler restart. Every
output must be identical to the run without a fault: requests resume by recompute, and greedy and
seeded sampling depend only on (seed, position). The fake runner reads its "KV" back through the
block tables, so a request resumed on a wrong or stale block shows in its tokens; invariants (the
scheduler's ledger and the KV manager each add up and agree) are checked after every step, and the
pool must be fully free (or idle in the prefix cache) at the end.
"""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from tests.engine.test_engine_prefix_caching import record_events
from tests.engine.test_scheduler import record_plans
from tests.support.recovery_runs import (
    FAULTS,
    Job,
    engine_for,
    recover,
    restart_kv_manager,
    restart_scheduler,
    restart_worker,
    run,
    workload,
)
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.events import BlockEvicted, KvPool, PipelineReset, Resumed
from vllm_actors.protocol.names import KV_CACHE_MANAGER, WORKER
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runner.sampler import Sampler


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_outputs_are_identical_after_a_restart_in_the_middle_of_a_run(fault: str, seed: int) -> None:
    jobs = workload(seed)
    engine, _ = engine_for()
    expected, steps = run(engine, jobs)
    assert engine.scheduler.stats.num_preemptions > 0 and engine.scheduler.stats.num_prefill_chunks > 0
    rng = random.Random(seed * 100 + len(fault))
    at = sorted(rng.sample(range(2, steps - 1), 2))  # two faults, somewhere in the run
    engine, _ = engine_for()
    events = record_events(engine)
    got, _ = run(engine, jobs, {k: FAULTS[fault]() for k in at})
    assert got == expected
    resets = [event for event in events if isinstance(event, PipelineReset)]
    if fault.startswith("scheduler"):
        assert not resets  # a new scheduler resets with its first plan, nothing to preempt
        resumed = {event.request_id for event in events if isinstance(event, Resumed)}
        assert resumed, "resubmitted requests with outputs resume (RESUMED)"
    else:
        assert len(resets) == 2 and engine.scheduler.stats.num_resets == 2
        actor = KV_CACHE_MANAGER if fault.startswith("kv") else WORKER
        assert all(reset.reason == f"{actor}: exited" for reset in resets)
    manager = engine.kv_cache_manager
    assert manager.num_free_blocks + manager.num_idle_cached_blocks == manager.pool.num_blocks


def test_a_fault_on_every_step_of_a_short_run_still_gives_the_same_outputs() -> None:
    """Restarts back to back, alternating the actor, one after every step: a reset while the
    previous reset plan is still in flight, requests preempted before they computed anything."""
    jobs = workload(4, count=6)
    engine, _ = engine_for(num_blocks=60)
    expected, steps = run(engine, jobs)
    cycle = [restart_kv_manager(), restart_worker("scrambled"), restart_scheduler(), restart_kv_manager(True)]
    engine, _ = engine_for(num_blocks=60)
    got, _ = run(engine, jobs, {k: cycle[k % len(cycle)] for k in range(1, 3 * steps)})
    assert got == expected


def test_a_recovery_with_nothing_running_resets_the_idle_pipeline() -> None:
    engine, runner = engine_for()
    events = record_events(engine)
    prompt = list(range(1, 30))
    expected, _ = run(engine, [Job("a", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    num_cached = len(engine.kv_cache_manager.cached)
    # 32 computed tokens (29 + 4 - 1), 8 full blocks: 7 stay cached, idle. The last block's last
    # token is the third output, known only after the last step was planned (two in flight).
    assert num_cached == 7
    engine.replace_actor(Worker(runner, Sampler(runner.device, 0), clock=time.perf_counter))
    recover(engine, WORKER, first=False)
    engine.run_until_idle()
    assert [e.num_preempted for e in events if isinstance(e, PipelineReset)] == [0]
    # The worker's KV is gone: the KV manager dropped its cache too (BLOCK_EVICTED, deepest first).
    assert not engine.kv_cache_manager.cached and engine.kv_cache_manager.num_free_blocks == 40
    evicted = [e for e in events if isinstance(e, BlockEvicted)][-1]
    assert len(evicted.block_hashes) == num_cached and evicted.parent_hashes[-1] == 0
    last_pool = [e for e in events if isinstance(e, KvPool)][-1]
    assert last_pool == KvPool(num_blocks=40, num_free=40, num_cached=0, num_cached_idle=0, num_in_use=0)
    again, _ = run(engine, [Job("b", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))])
    assert again["b"] == expected["a"]

# ------------------------------------------------------------------ the tiny real model
@pytest.mark.parametrize("fault", ["worker-stale", "scheduler"])
def test_tiny_model_outputs_are_identical_after_a_restart(fault: str, tiny_qwen3: Any) -> None:
    """Real attention over real (stale, after a worker restart) KV tensors: a resumed request that
    read a block it did not recompute would drift."""
    from vllm_actors.protocol.config import EngineConfig

    config = EngineConfig(model=str(tiny_qwen3), dtype="float32", block_size=16, num_gpu_blocks_override=12,
                          max_num_batched_tokens=32, seed=0, device="cpu")
    rng = random.Random(5)
    shared = [rng.randrange(500) for _ in range(40)]
    jobs = [
        Job(f"r{i}", (shared if i % 2 else []) + [rng.randrange(500) for _ in range(rng.randint(5, 50))],
            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) if i % 3 else
            SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True, n=2))
        for i in range(6)
    ]
    engine = InProcessEngine(config)
    plans = record_plans(engine)
    expected, steps = run(engine, jobs)
    assert engine.scheduler.stats.num_preemptions > 0
    assert any(new.num_cached_tokens for plan in plans for new in plan.new_requests)
    engine = InProcessEngine(config)
    got, _ = run(engine, jobs, {steps // 3: FAULTS[fault](), 2 * steps // 3: FAULTS[fault]()})
    assert got == expected
