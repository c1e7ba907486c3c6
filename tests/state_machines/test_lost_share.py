"""A dead KV-parallel rank's share (``actors/worker/lost_share.py``): the runs of computed positions
whose blocks it held, adjacent lost blocks joined, a partial last block cut at the computed count;
the recovery batch (one sequence per run, on its request's table, nothing sampled); bad input
refused with what is allowed."""

from __future__ import annotations

import pytest

from vllm_actors.actors.worker.lost_share import HeldRequest, LostRun, lost_runs, recovery_batch, split_step

BLOCK = 4


def test_interleaved_blocks_lose_every_other_block_up_to_the_computed_count() -> None:
    table = [0, 1, 2, 3, 4, 5]  # block b on rank b % 2
    assert lost_runs(table, 22, BLOCK, rank=1, size=2) == [LostRun(4, 4), LostRun(12, 4), LostRun(20, 2)]
    assert lost_runs(table, 22, BLOCK, rank=0, size=2) == [LostRun(0, 4), LostRun(8, 4), LostRun(16, 4)]
    assert lost_runs(table, 4, BLOCK, rank=1, size=2) == []  # the block past the computed tokens holds nothing
    assert lost_runs([], 0, BLOCK, rank=0, size=3) == []


def test_adjacent_lost_blocks_join_into_one_run() -> None:
    # blocks lent by the rank with the most room: 5 and 7 (rank 1 of 2) are adjacent in the table
    assert lost_runs([0, 5, 7, 2, 9], 19, BLOCK, rank=1, size=2) == [LostRun(4, 8), LostRun(16, 3)]
    assert LostRun(4, 8).end == 12


def test_recovery_batch_is_one_sequence_per_run_on_its_requests_table() -> None:
    long = HeldRequest(token_ids=list(range(100, 114)), block_table=[6, 3, 8, 1], num_computed_tokens=13)
    short = HeldRequest(token_ids=[7, 8, 9], block_table=[4], num_computed_tokens=3)  # all on a survivor
    batch = recovery_batch([long, short], BLOCK, rank=1, size=2)
    assert batch.query_lens == [4, 1]  # block 3 (positions 4..7) and block 1 (position 12 of 13 computed)
    assert batch.seq_lens == [8, 13]
    assert batch.positions == [4, 5, 6, 7, 12]
    assert batch.token_ids == [104, 105, 106, 107, 112]
    assert batch.block_tables == [[6, 3, 8, 1], [6, 3, 8, 1]]
    assert recovery_batch([short], BLOCK, rank=1, size=2).token_ids == []


def test_bad_input_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="KV-parallel rank 2 outside a group of 2"):
        lost_runs([0, 1], 8, BLOCK, rank=2, size=2)
    with pytest.raises(ValueError, match="kv_parallel_size >= 2"):
        lost_runs([0, 1], 8, BLOCK, rank=0, size=1)
    with pytest.raises(ValueError, match="a table of 2 blocks of 4 holds 8"):
        lost_runs([0, 1], 9, BLOCK, rank=0, size=2)
    with pytest.raises(ValueError, match="a token still pending"):
        recovery_batch([HeldRequest([1, 2], [0], 3)], BLOCK, rank=0, size=2)


def test_positions_from_recompute_from_are_lost_on_every_rank() -> None:
    # blocks cached by steps lost with the rank: positions 10.. recomputed whatever rank holds them
    table = [0, 1, 2, 3, 4, 5]
    assert lost_runs(table, 22, BLOCK, rank=1, size=2, recompute_from=10) == [LostRun(4, 4), LostRun(10, 12)]
    assert lost_runs(table, 22, BLOCK, rank=1, size=2, recompute_from=22) == lost_runs(table, 22, BLOCK, 1, 2)
    held = HeldRequest(list(range(22)), table, 22, recompute_from=0)
    assert recovery_batch([held], BLOCK, rank=0, size=2).query_lens == [22]


def test_a_recovery_step_splits_into_steps_of_the_token_budget_in_order() -> None:
    long = HeldRequest(token_ids=list(range(100, 122)), block_table=[0, 1, 2, 3, 4, 5], num_computed_tokens=22)
    whole = recovery_batch([long], BLOCK, rank=1, size=2)  # runs 4..7, 12..15, 20..21
    steps = split_step(whole, 3)
    assert [step.query_lens for step in steps] == [[3], [1, 2], [2, 1], [1]]
    assert [step.seq_lens for step in steps] == [[7], [8, 14], [16, 21], [22]]
    assert [p for step in steps for p in step.positions] == whole.positions
    assert [t for step in steps for t in step.token_ids] == whole.token_ids
    assert split_step(whole, 100)[0].query_lens == whole.query_lens
    with pytest.raises(ValueError, match="max_tokens=0"):
        split_step(whole, 0)
