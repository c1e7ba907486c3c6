"""The worker's block tables as one numpy array: a row per running request, kept across steps.

Appending a block writes one cell; a step's tables are its rows read in place (``rows_of``:
``TableRows``, copied into the step's inputs as one gather, or row by row beside one long
context), instead of rebuilding and padding Python lists for every sequence every step.
"""

from __future__ import annotations

import numpy as np

from vllm_actors.actors.worker.step_data import TableRows


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

    def gather(self, rows: list[int], width: int | None = None) -> np.ndarray:
        """[len(rows), width] int32; width defaults to the longest of these rows."""
        index = np.asarray(rows, dtype=np.int64)
        if width is None:
            width = max(int(self.lengths[index].max(initial=0)), 1)
        return self.table[index, :width]
