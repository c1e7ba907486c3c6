"""The worker's block tables as one numpy array: a row per running request, kept across steps.

Appending a block writes one cell; a step's tables are its rows read in place (``rows_of``:
``TableRows``, copied into the step's inputs as one gather, or row by row beside one long
context), instead of rebuilding and padding Python lists for every sequence every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ``TableRows.copy_into`` copies row by row where the gathered [B, width] area is this many times the blocks
# the rows hold (plus ``DENSE_CELLS``): one long context among short ones (a 1M-token prompt's ~62,000 blocks
# beside 120 requests of ~140) made the step's gather and its copy into the staging buffer 30 MB each (the
# step's batch and inputs 6.7 ms of host time, 0.9 ms row by row, on a 2-core machine); a decode batch of
# short rows stays one gather.
SPARSE_FACTOR = 4
DENSE_CELLS = 1 << 16


class BlockTableArray:
    def __init__(self, max_blocks_per_seq: int, capacity: int = 64) -> None:
        self.width = max_blocks_per_seq
        self.table = np.zeros((capacity, max_blocks_per_seq), dtype=np.int32)
        self.lengths = np.zeros(capacity, dtype=np.int32)
        self._free_rows = list(range(capacity - 1, -1, -1))

    def add(self) -> int:
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.lengths[row] = 0
        return row

    def _grow(self) -> None:
        old = self.table.shape[0]
        self.table = np.concatenate([self.table, np.zeros_like(self.table)])
        self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def append(self, row: int, blocks: list[int]) -> None:
        if not blocks:
            return
        start = int(self.lengths[row])
        end = start + len(blocks)
        if end > self.width:
            raise ValueError(f"a sequence may hold at most {self.width} blocks, asked for {end}")
        self.table[row, start:end] = blocks
        self.lengths[row] = end

    def truncate(self, row: int, length: int) -> None:
        """The row keeps its first ``length`` blocks."""
        self.lengths[row] = min(int(self.lengths[row]), length)

    def remove(self, row: int) -> None:
        self.lengths[row] = 0
        self._free_rows.append(row)

    def rows_of(self, rows: list[int]) -> TableRows:
        """These rows as they are now, read in place (``TableRows``)."""
        index = np.asarray(rows, dtype=np.int64)
        return TableRows(self.table, index, self.lengths[index])


@dataclass(frozen=True, slots=True)
class TableRows:
    """A step's rows of the worker's block tables (``BatchInput.table_rows``), read in place when the step's
    inputs are filled (right after the batch is built: appends for later steps go past these lengths)."""

    table: np.ndarray  # the BlockTableArray's array
    rows: np.ndarray  # [B] int64: the step's sequences' rows
    lengths: np.ndarray  # [B] int32: their blocks

    @property
    def width(self) -> int:
        return max(int(self.lengths.max(initial=0)), 1)

    def gather(self) -> np.ndarray:
        """[B, width] int32 (beyond a row's length: whatever the array holds there)."""
        return self.table[self.rows, : self.width]

    def select(self, index: np.ndarray) -> TableRows:
        return TableRows(self.table, self.rows[index], self.lengths[index])

    def blocks_at(self, sequences: np.ndarray, block_index: np.ndarray) -> np.ndarray:
        """The block ids at ``block_index`` of each of ``sequences`` (indices into the step's rows)."""
        return self.table[self.rows[sequences], block_index]

    def copy_into(self, view: np.ndarray, width: int) -> int:
        """``view[:B, :width]`` holds the rows' blocks (beyond a row's length: block ids of earlier steps,
        never read: every kernel reads a row up to its sequence length); returns the columns written
        (the rest of ``width`` is the caller's to clear)."""
        count, used = len(self.rows), min(self.width, width)
        if count * used <= SPARSE_FACTOR * int(self.lengths.sum()) + DENSE_CELLS:
            view[:count, :used] = self.table[self.rows, :used]
        else:
            for index, (row, length) in enumerate(zip(self.rows.tolist(), self.lengths.tolist(), strict=True)):
                view[index, : min(length, used)] = self.table[row, : min(length, used)]
        return used
