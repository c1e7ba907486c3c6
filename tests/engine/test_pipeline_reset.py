"""A reset plan at the KV-cache manager and the worker: each drops every request, table and cached
block it held before the reset, takes the plan's requests as fresh and ignores plans from before it."""

from __future__ import annotations

import time

import pytest

from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import BlockEvicted, Freed, KvPool
from vllm_actors.protocol.messages import NewRequest, PassThroughPlan, StepPlan, StepResult
from vllm_actors.protocol.names import KV_CACHE_MANAGER, SCHEDULER, WORKER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.protocol.token_ids import pack_token_ids
from vllm_actors.runner.sampler import Sampler


def new_request(request_id: str, tokens: list[int]) -> NewRequest:
    return NewRequest(request_id=request_id, token_ids=pack_token_ids(tokens), num_prompt_tokens=len(tokens),
                      num_output_tokens=0, params=SamplingParams(max_tokens=4), eos_token_ids=[0])


def test_kv_manager_reset_drops_everything_and_forwards_the_reset() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(1, 11))
    first, second = 11, 22  # hashes are labels here: the manager checks only their chain
    manager.handle(StepPlan(step_id=0, new_requests=[new_request("a", tokens)], req_ids=["a"], num_tokens=[10],
                            num_blocks=[3], cached_hashes={"a": [first, second]}))
    manager.handle(StepPlan(step_id=1, new_requests=[new_request("b", [9] * 5)], req_ids=["b"], num_tokens=[5],
                            num_blocks=[2]))
    assert manager.pool.num_free == 11
    # Stale plans (below the last reset) are dropped unapplied, once a reset was seen.
    reset = StepPlan(step_id=5, reset=True, new_requests=[new_request("a", tokens)], req_ids=["a"],
                     num_tokens=[10], num_blocks=[3])
    out = manager.handle(reset)
    forwarded = out.to(WORKER)
    assert len(forwarded) == 1 and forwarded[0].reset and forwarded[0].new_block_ids == [[0, 1, 2]]
    assert [d for d, _ in out.messages] == [WORKER]
    events = out.events
    assert sorted(e.request_id for e in events if isinstance(e, Freed)) == ["a", "b"]
    (evicted,) = [e for e in events if isinstance(e, BlockEvicted)]
    assert evicted.block_hashes == [second, first] and evicted.parent_hashes == [first, 0]  # deepest first
    pools = [e for e in events if isinstance(e, KvPool)]
    assert pools[0] == KvPool(num_blocks=16, num_free=16, num_cached=0, num_cached_idle=0, num_in_use=0)
    assert pools[-1].num_free == 13
    assert set(manager.block_tables) == {"a"} and not manager.cached
    manager.check_invariants({"a"})
    assert manager.handle(StepPlan(step_id=4, finished_ids=["a"])) == Outputs()  # planned before the reset
    assert manager.block_tables["a"] == [0, 1, 2]


def test_kv_manager_rejects_a_bad_reset_plan_without_dropping_anything() -> None:
    from vllm_actors.protocol.errors import MessageRejected

    manager = KVCacheManager(num_blocks=4, block_size=4)
    manager.handle(StepPlan(step_id=0, new_requests=[new_request("a", [1] * 6)], req_ids=["a"], num_tokens=[6],
                            num_blocks=[2]))
    with pytest.raises(MessageRejected):
        manager.handle(StepPlan(step_id=1, reset=True, req_ids=["a"], num_tokens=[1], num_blocks=[2]))
    assert manager.block_tables == {"a": [0, 1]}


def test_kv_manager_resets_on_its_pass_through_view_too() -> None:
    """Over the wire the manager decodes plans as ``PassThroughPlan``: ``reset`` survives it and
    the forwarded plan, re-encoded, still carries it and the sampling parameters."""
    manager = KVCacheManager(num_blocks=8, block_size=4)
    manager.handle(StepPlan(step_id=0, new_requests=[new_request("old", [1] * 6)], req_ids=["old"],
                            num_tokens=[6], num_blocks=[2]))
    wire, kv_codec = MessageCodec(), MessageCodec.for_actor(KV_CACHE_MANAGER)
    plan = StepPlan(step_id=3, reset=True, new_requests=[new_request("a", [2] * 5)], req_ids=["a"],
                    num_tokens=[5], num_blocks=[2])
    decoded = kv_codec.decode(wire.encode(plan))
    assert isinstance(decoded, PassThroughPlan) and decoded.reset
    (forwarded,) = manager.handle(decoded).to(WORKER)
    again = wire.decode(wire.encode(forwarded))
    assert isinstance(again, StepPlan) and again.reset and again.new_requests[0].params.max_tokens == 4
    assert set(manager.block_tables) == {"a"} and manager.pool.num_free == 6


def test_worker_reset_drops_every_request_and_table_row() -> None:
    runner = FakeRunner(num_blocks=16, block_size=4, max_blocks_per_seq=4)  # the worker keeps a table array
    worker = Worker(runner, Sampler(runner.device, 0), clock=time.perf_counter)
    worker.handle(StepPlan(step_id=0, new_requests=[new_request("a", [1] * 6), new_request("b", [2] * 3)],
                           req_ids=["a", "b"], num_tokens=[6, 3], num_blocks=[2, 1], new_block_ids=[[0, 1], [2]]))
    assert set(worker.requests) == {"a", "b"}
    # A reset plan may schedule an id the worker holds as new, on other blocks: validated as fresh.
    out = worker.handle(StepPlan(step_id=4, reset=True, new_requests=[new_request("b", [2] * 3)], req_ids=["b"],
                                 num_tokens=[3], num_blocks=[1], new_block_ids=[[5]]))
    (result,) = out.to(SCHEDULER)
    assert result.reset and result.step_id == 4 and result.req_ids == ["b"]
    assert set(worker.requests) == {"b"} and worker.requests["b"].block_table == [5]
    assert worker.tables is not None and int(worker.tables.lengths[worker.requests["b"].row]) == 1
    # A plan of before the reset (say, queued behind it from the dead KV manager) is dropped.
    assert not worker.handle(StepPlan(step_id=3, req_ids=["a"], num_tokens=[1], num_blocks=[2],
                                      new_block_ids=[[]]))
    empty = worker.handle(StepPlan(step_id=9, reset=True)).to(SCHEDULER)
    assert empty == [StepResult(step_id=9, reset=True, req_ids=[], token_ids=[])] and not worker.requests

