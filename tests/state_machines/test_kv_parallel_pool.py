"""The KV-cache manager's pool under KV parallelism (block_pool.py), and the kv_parallel_size
checks: a request's j-th block on rank j % KVP while that rank has room, any rank's otherwise (the
whole pool stays usable, so allocation is all or nothing on the total the scheduler counts);
prefix-cache hits keep their blocks (and so their ranks) at the same table positions."""

from __future__ import annotations

import pytest

from tests.state_machines.test_host_tier import FIRST, SECOND, new
from vllm_actors.actors.kv_cache_manager.block_pool import BlockPool, BlockPoolExhausted
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.engine_args import make_engine_config
from vllm_actors.protocol.messages import StepPlan


def test_blocks_are_interleaved_by_table_position() -> None:
    pool = BlockPool(12, ranks=3)
    first = pool.allocate(5)
    assert [block % 3 for block in first] == [0, 1, 2, 0, 1]
    grown = pool.allocate(2, first_index=5)  # the same request's 6th and 7th blocks
    assert [block % 3 for block in grown] == [2, 0]
    assert pool.free_per_rank() == [1, 2, 2]


def test_a_full_rank_lends_to_the_others_and_the_whole_pool_is_usable() -> None:
    pool = BlockPool(6, ranks=2)
    pool.allocate(3, first_index=0)  # ranks 0, 1, 0
    assert pool.free_per_rank() == [1, 2]
    rest = pool.allocate(3, first_index=0)  # wants 0, 1, 0: rank 0 has one, rank 1 takes the third
    assert sorted(block % 2 for block in rest) == [0, 1, 1]
    assert pool.num_free == 0
    with pytest.raises(BlockPoolExhausted):
        pool.allocate(1)
    pool.release(rest)
    assert pool.free_per_rank() == [1, 2] and pool.num_free == 3


def test_one_rank_keeps_the_plain_free_list_order() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]


def test_pool_size_must_split_over_the_ranks() -> None:
    with pytest.raises(ValueError, match="must be a multiple of the KV-parallel ranks"):
        BlockPool(5, ranks=2)


def test_manager_interleaves_and_prefix_hits_keep_their_ranks() -> None:
    manager = KVCacheManager(8, block_size=4, kv_parallel_size=2)
    plan = manager.assign_blocks(StepPlan(step_id=0, new_requests=[new("a", 0, 0)], req_ids=["a"], num_tokens=[9],
                                          num_blocks=[3], cached_hashes={"a": [FIRST, SECOND]}))
    assert [block % 2 for block in plan.new_block_ids[0]] == [0, 1, 0]
    plan = manager.assign_blocks(StepPlan(step_id=1, req_ids=["a"], num_tokens=[4], num_blocks=[4]))
    assert [block % 2 for block in plan.new_block_ids[0]] == [1]
    manager.check_invariants()
    plan = manager.assign_blocks(StepPlan(step_id=2, finished_ids=["a"], new_requests=[new("b", 8, SECOND)],
                                          req_ids=["b"], num_tokens=[1], num_blocks=[3]))
    assert [block % 2 for block in plan.new_block_ids[0]] == [0, 1, 0]  # two hits in place, then a new block
    manager.check_invariants()


@pytest.mark.parametrize(("args", "message"), [
    (dict(kv_parallel_size=2, pipeline_parallel_size=2), "with pipeline_parallel_size 2 is not supported yet"),
    (dict(kv_parallel_size=2, kv_cache_offload_gb=1.0), "with kv_cache_offload_gb 1.0 is not supported yet"),
    (dict(kv_parallel_size=2, num_gpu_blocks_override=7), r"must be a multiple of kv_parallel_size \(2\)"),
    (dict(kv_parallel_size=0), "kv_parallel_size must be a positive integer"),
    (dict(kv_parallel_size=2, enable_lora=True), "with enable_lora or speculative_config is not supported yet"),
    (dict(kv_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "with enable_lora or speculative_config is not supported yet"),
])
def test_unsupported_kv_parallel_arguments_are_value_errors(args: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_engine_config("model", args)


def test_kv_parallel_composes_with_tp_as_kvp_times_tp_workers() -> None:
    config = make_engine_config("model", dict(kv_parallel_size=2, tensor_parallel_size=3))
    assert config.world_size == 6 and config.answering_rank == 0
