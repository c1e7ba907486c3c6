"""The host KV tier's state machines in process: block runs, the KV-cache manager's host slots (a
block in exactly one tier, the bound, what it refuses), the scheduler ledger's decisions within a
planning pass, and the worker's checks of a plan's copies."""

from __future__ import annotations

import pytest

from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.actors.scheduler.block_ledger import BlockLedger
from vllm_actors.actors.worker.plan_checks import check_plan
from vllm_actors.protocol.block_hash import block_hash
from vllm_actors.protocol.block_runs import iter_runs, to_runs
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.events import BlockEvicted, BlockOffloaded, BlockRestored, PrefixHit
from vllm_actors.protocol.messages import NewRequest, StepPlan
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids

TOKENS = list(range(1, 10))  # two full blocks of 4 and one token
FIRST = block_hash(0, TOKENS[:4])
SECOND = block_hash(FIRST, TOKENS[4:8])


def new(request_id: str, cached: int, last: int) -> NewRequest:
    return NewRequest(request_id=request_id, token_ids=pack_token_ids(TOKENS), num_prompt_tokens=9,
                      num_output_tokens=0, params=SamplingParams(max_tokens=1), eos_token_ids=[0],
                      num_cached_tokens=cached, cached_block_hash=last)


def offloaded_manager(num_host_blocks: int = 4) -> tuple[KVCacheManager, list[object]]:
    """A manager whose two cached blocks went to the host tier."""
    manager = KVCacheManager(num_blocks=8, block_size=4, num_host_blocks=num_host_blocks)
    events: list[object] = []
    manager.assign_blocks(StepPlan(step_id=0, new_requests=[new("a", 0, 0)], req_ids=["a"], num_tokens=[9],
                                   num_blocks=[3], cached_hashes={"a": [FIRST, SECOND]}), events)
    plan = manager.assign_blocks(StepPlan(step_id=1, finished_ids=["a"], evicted_hashes=[SECOND, FIRST]), events)
    assert sorted(iter_runs(plan.offload_copies)) == [(0, 0, 2)], "a chain offloads as one run"
    manager.check_invariants()
    return manager, events


def test_block_runs_merge_consecutive_pairs_in_source_order() -> None:
    assert to_runs([2, 0, 1, 7], [12, 10, 11, 3]) == [0, 10, 3, 7, 3, 1]
    assert to_runs([], []) == []
    with pytest.raises(ValueError, match="in threes"):
        list(iter_runs([1, 2]))


def test_evicted_blocks_move_to_the_host_and_back_into_fresh_blocks() -> None:
    manager, events = offloaded_manager()
    assert not manager.cached and set(manager.host.entries) == {FIRST, SECOND}
    assert not any(isinstance(event, BlockEvicted) for event in events), "offloaded blocks stay cached"
    offloaded = [event for event in events if isinstance(event, BlockOffloaded)]
    assert offloaded[0].num_blocks == 2 and offloaded[0].num_host_cached == 2
    events.clear()
    plan = manager.assign_blocks(StepPlan(step_id=2, restored_hashes=[FIRST, SECOND],
                                          new_requests=[new("b", 8, SECOND)], req_ids=["b"], num_tokens=[1],
                                          num_blocks=[3]), events)
    manager.check_invariants({"b"})
    assert not manager.host.entries and set(manager.cached) == {FIRST, SECOND}
    restored = [(slot, block) for slot, block, count in iter_runs(plan.restore_copies) for _ in range(count)]
    assert len(restored) == 2
    hit = next(event for event in events if isinstance(event, PrefixHit))
    assert hit.block_ids == manager.block_tables["b"][:2] and hit.num_cached_tokens == 8
    assert next(event for event in events if isinstance(event, BlockRestored)).num_blocks == 2


def test_the_manager_refuses_host_moves_it_cannot_carry_out() -> None:
    manager, _ = offloaded_manager(num_host_blocks=2)
    unknown = block_hash(SECOND, [1, 2, 3, 4])
    for plan, match in [
        (StepPlan(step_id=2, restored_hashes=[unknown]), "host tier does not hold"),
        (StepPlan(step_id=2, host_dropped_hashes=[unknown]), "does not hold"),
        (StepPlan(step_id=2, restored_hashes=[FIRST, FIRST]), "twice"),
        (StepPlan(step_id=2, new_requests=[new("b", 8, SECOND)], req_ids=["b"], num_tokens=[1], num_blocks=[3]),
         "not cached"),  # a hit on host blocks the plan does not restore
    ]:
        with pytest.raises(MessageRejected, match=match):
            manager.assign_blocks(plan)
        manager.check_invariants()
    without = KVCacheManager(num_blocks=8, block_size=4)
    with pytest.raises(MessageRejected, match="there is none"):
        without.assign_blocks(StepPlan(step_id=0, restored_hashes=[FIRST]))


def test_a_host_drop_and_a_reset_leave_the_cache_with_tier_host_events() -> None:
    manager, events = offloaded_manager()
    events.clear()
    manager.assign_blocks(StepPlan(step_id=2, host_dropped_hashes=[SECOND]), events)
    assert [(e.block_hashes, e.tier) for e in events if isinstance(e, BlockEvicted)] == [([SECOND], "host")]
    events.clear()
    manager.assign_blocks(StepPlan(step_id=3, reset=True), events)
    assert [(e.block_hashes, e.tier) for e in events if isinstance(e, BlockEvicted)] == [([FIRST], "host")]
    assert not manager.host.entries
    manager.check_invariants()


def test_the_ledger_keeps_the_host_bound_and_puts_back_a_block_taken_and_evicted_in_one_pass() -> None:
    ledger = BlockLedger(num_blocks=3, block_size=4, enable_caching=True, num_host_blocks=2)
    ledger.admit("a", TOKENS)
    ledger.allocate("a", 3)
    assert ledger.cache_blocks("a", 2, lambda start, end: TOKENS[start:end]) == [FIRST, SECOND]
    ledger.release("a")
    ledger.take_evicted(), ledger.take_host_moves()
    ledger.admit("x", None)
    ledger.allocate("x", 3)  # evicts both cached blocks to the host
    assert ledger.take_evicted() == [SECOND, FIRST] and ledger.take_host_moves() == ([], [])
    assert set(ledger.host.blocks) == {FIRST, SECOND}  # type: ignore[union-attr]  # a host tier was asked for
    ledger.release("x")
    assert ledger.admit("b", TOKENS) == (2, SECOND), "the host blocks count as a hit"
    ledger.release("b")
    ledger.admit("y", None)
    ledger.allocate("y", 3)  # the same pass evicts them again: the plan moves nothing
    assert ledger.take_evicted() == [] and ledger.take_host_moves() == ([], [])
    assert set(ledger.host.blocks) == {FIRST, SECOND}  # type: ignore[union-attr]
    ledger.release("y")
    ledger.check_invariants(set())


def test_a_prefix_cache_reset_empties_the_host_tier_too() -> None:
    """/reset_prefix_cache: no prompt may hit a host copy of a block the reset dropped from the GPU."""
    ledger = BlockLedger(num_blocks=3, block_size=4, enable_caching=True, num_host_blocks=2)
    ledger.admit("a", TOKENS)
    ledger.allocate("a", 3)
    ledger.cache_blocks("a", 2, lambda start, end: TOKENS[start:end])
    ledger.release("a")
    ledger.admit("x", None)
    ledger.allocate("x", 3)  # both cached blocks go to the host
    ledger.release("x")
    ledger.take_evicted(), ledger.take_host_moves()
    assert set(ledger.host.blocks) == {FIRST, SECOND}  # type: ignore[union-attr]  # a host tier was asked for
    ledger.evict_idle()
    assert not ledger.host.blocks  # type: ignore[union-attr]
    assert set(ledger.take_host_moves()[0]) == {FIRST, SECOND}, "the next plan drops them from the host pool"
    assert ledger.admit("b", TOKENS)[0] == 0, "no hit after the reset"
    ledger.release("b")
    ledger.check_invariants(set())


def test_the_worker_refuses_copies_outside_its_host_tier() -> None:
    def check(plan: StepPlan, num_host_blocks: int) -> None:
        check_plan(plan, {}, has_grammars=False, num_blocks=8, table_width=None, num_host_blocks=num_host_blocks)

    check(StepPlan(step_id=0, offload_copies=[6, 2, 2], restore_copies=[0, 0, 1]), num_host_blocks=4)
    with pytest.raises(MessageRejected, match="has none"):
        check(StepPlan(step_id=0, offload_copies=[0, 0, 1]), num_host_blocks=0)
    with pytest.raises(MessageRejected, match="outside"):
        check(StepPlan(step_id=0, restore_copies=[3, 7, 2]), num_host_blocks=4)
    with pytest.raises(MessageRejected, match="threes"):
        check(StepPlan(step_id=0, restore_copies=[3, 7]), num_host_blocks=4)


def test_kv_cache_offload_gb_is_checked_and_sizes_the_fake_tier() -> None:
    with pytest.raises(ValueError, match="kv_cache_offload_gb"):
        EngineConfig(model="fake", kv_cache_offload_gb=-1.0)
    assert EngineConfig(model="fake", kv_cache_offload_gb=0.5).kv_cache_offload_bytes == 1 << 29
    assert FakeRunner(num_blocks=4, block_size=4).host_tier is None


def test_the_metrics_store_counts_blocks_offloaded_restored_and_dropped() -> None:
    from vllm_actors.actors.metrics_store.store import MetricsStore
    from vllm_actors.protocol.events import EventBatch
    from vllm_actors.protocol.metrics import SummaryQuery, SummaryReply

    store = MetricsStore()
    store.record(EventBatch(actor="kv_cache_manager", first_seq=0, mono=1.0, wall=2.0, events=[
        BlockOffloaded(copies=[0, 0, 62_500], num_blocks=62_500, num_host_cached=62_500, num_host_blocks=70_000),
        BlockRestored(copies=[0, 5, 100], num_blocks=100, num_host_cached=62_400, num_host_blocks=70_000),
        BlockEvicted(block_ids=[7], block_hashes=[FIRST], parent_hashes=[0], tier="host"),
    ]))
    reply = store.query(SummaryQuery())
    assert isinstance(reply, SummaryReply)
    assert (reply.kv_blocks_offloaded, reply.kv_blocks_restored, reply.kv_blocks_evicted) == (62_500, 100, 1)


def test_copies_fence_on_the_step_that_last_used_their_blocks() -> None:
    from vllm_actors.actors.worker.copy_fences import CopyFences

    fences = CopyFences()
    assert fences.launched() == 1
    fences.release([0, 1])  # a request left after step 1 was launched: step 1 may still read them
    fences.launched(), fences.launched()
    assert fences.fence([], [9, 0, 2]) == 1, "a restore into blocks 0 and 1 waits for step 1, not step 3"
    assert fences.fence([1, 4, 1], []) == 1
    assert fences.fence([5, 0, 1], [0, 6, 2]) == 0, "blocks nobody left since: no wait"
    fences.release([6])
    assert fences.fence([], [0, 6, 1]) == 3
    fences.reset()
    assert fences.fence([], [0, 7, 1]) == 3, "after a reset every block waits for the last step before it"


def test_a_host_tier_too_small_for_one_block_is_refused() -> None:
    from vllm_actors.runner.host_kv_tier import num_host_blocks

    assert num_host_blocks(EngineConfig(model="fake"), 4096) == 0
    assert num_host_blocks(EngineConfig(model="fake", kv_cache_offload_gb=1.0), 1 << 20) == 1024
    with pytest.raises(ValueError, match="holds no KV block"):
        num_host_blocks(EngineConfig(model="fake", kv_cache_offload_gb=1e-9), 4096)


def test_the_host_tiers_shared_memory_outlives_the_worker_that_mapped_it() -> None:
    """The supervisor's memfd: a second host tier mapping it (a restarted worker) finds the blocks
    the first one copied there; the owner's descriptors are closed by ``close`` and by garbage
    collection alike."""
    import gc
    import os

    import torch

    from vllm_actors.runner.host_kv_tier import HostKvTier
    from vllm_actors.runtime.host_memory import FD_VARIABLE, HostKvMemory

    memory = HostKvMemory()
    fd = memory.fd_for("worker-0")
    assert memory.fd_for("worker-0") == fd and memory.environment("worker-0", {})[FD_VARIABLE] == str(fd)
    kv = [(torch.randn(6, 4, 2, 8), torch.randn(6, 4, 2, 8)) for _ in range(2)]
    first = HostKvTier(kv, num_blocks=3, memory_fd=fd)
    first.write_through(to_runs([4, 5], [1, 2]), fence=1)
    del first
    fresh = [(torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8)) for _ in range(2)]
    second = HostKvTier(fresh, num_blocks=3, memory_fd=fd)
    second.copy([], to_runs([1, 2], [0, 1]), fence=0)
    for (key, value), (new_key, new_value) in zip(kv, fresh, strict=True):
        assert torch.equal(new_key[:2], key[4:6]) and torch.equal(new_value[:2], value[4:6])
    memory.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    other = HostKvMemory()
    fd = other.fd_for("worker-1")
    del other
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
