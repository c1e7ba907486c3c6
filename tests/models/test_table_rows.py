"""A step's block tables read in place from the worker's array (``step_data.TableRows``): the rows a
step's inputs get are the rows' blocks whether copied as one gather or row by row, and one long context
among short ones is copied row by row (its [B, width] gather would be mostly padding: a 1M-token prompt's
62,500 blocks beside 120 short requests made 30 MB gathered and copied again per step: 6.7 ms of host
time for the step's batch and inputs at 990k on a 2-core machine, 0.9 ms row by row)."""

from __future__ import annotations

import numpy as np

from vllm_actors.actors.worker.block_tables import BlockTableArray, TableRows
from vllm_actors.actors.worker.step_data import BatchInput

SENTINEL = -7


def tables_of(lengths: list[int]) -> tuple[BlockTableArray, list[int]]:
    array = BlockTableArray(max_blocks_per_seq=max(lengths) + 8, capacity=4)
    rows = []
    for index, length in enumerate(lengths):
        row = array.add()
        array.append(row, [1000 * (index + 1) + block for block in range(length)])
        rows.append(row)
    return array, rows


def copied(table_rows: TableRows, width: int) -> tuple[np.ndarray, int]:
    view = np.full((len(table_rows.rows) + 2, width + 4), SENTINEL, dtype=np.int32)
    return view, table_rows.copy_into(view, width)


def test_one_long_row_among_short_ones_is_copied_row_by_row() -> None:
    lengths = [3] * 20 + [20_000] + [5] * 9
    array, rows = tables_of(lengths)
    table_rows = array.rows_of(rows)
    view, used = copied(table_rows, 20_000)
    assert used == 20_000
    for index, length in enumerate(lengths):
        assert view[index, :length].tolist() == [1000 * (index + 1) + block for block in range(length)]
    assert (view[0, 3:] == SENTINEL).all()  # nothing past a short row's blocks: no 30 MB of padding written
    gathered = table_rows.gather()
    assert gathered.shape == (len(lengths), 20_000)
    assert np.array_equal(gathered[20, :], view[20, :20_000])


def test_short_rows_are_one_gather_and_the_batch_reads_them_in_place() -> None:
    lengths = [4, 6, 2]
    array, rows = tables_of(lengths)
    table_rows = array.rows_of(rows)
    view, used = copied(table_rows, 10)
    assert used == 6 and view[1, :6].tolist() == [2000 + block for block in range(6)]
    assert view[2, 2:6].tolist() != [SENTINEL] * 4  # one gather writes the whole [B, longest] area
    batch = BatchInput([], [], [], [], [[1000 + b for b in range(4)], [2000 + b for b in range(6)], [3000, 3001]], [],
                       table_rows=table_rows)
    assert batch.block_ids(np.array([0, 1, 2]), np.array([3, 5, 1])).tolist() == [1003, 2005, 3001]
    assert batch.table_array()[1, :6].tolist() == [2000 + block for block in range(6)]  # gathered on demand
    verify = table_rows.select(np.array([1, 1, 0]))  # a verification step's rows: its sequences repeated
    assert verify.blocks_at(np.array([0, 2]), np.array([4, 0])).tolist() == [2004, 1000]
    array.append(rows[0], [9999])  # a later step's block goes past the lengths the step read
    assert table_rows.lengths.tolist() == lengths
