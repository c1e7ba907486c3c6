"""The fake model runner taking deferred input ids and moving the rows that follow a pending
verification as the model runner does (``runner/deferred_inputs.fix_overlap`` on CPU tensors), so
a wrong accepted count, position, slot or input id changes the fake model's tokens."""

from __future__ import annotations

import torch

from tests.support.fake_runner import FakeRunner
from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.runner.deferred_inputs import fill_deferred, fix_overlap


class OverlapFakeRunner(FakeRunner):
    supports_deferred_inputs = True
    supports_overlap_rows = True
    num_deferred: int = 0
    num_moved: int = 0  # rows moved by a pending verification's accepted counts

    def execute(self, batch: BatchInput) -> torch.Tensor:
        if batch.deferred is None and batch.overlap is None:
            return super().execute(batch)
        tables = batch.table_array()
        positions = torch.tensor(batch.positions, dtype=torch.long)
        inputs = {
            "input_ids": torch.tensor(batch.token_ids, dtype=torch.long),
            "positions": positions,
            "slot_mapping": torch.zeros(len(batch.positions), dtype=torch.long),
            "seq_lens": torch.tensor(batch.seq_lens, dtype=torch.int32),
            "block_tables": torch.from_numpy(tables.copy()),
        }
        if batch.deferred is not None:
            self.num_deferred += len(batch.deferred.flat_index)
            pairs = torch.tensor([batch.deferred.flat_index, batch.deferred.source_row], dtype=torch.long)
            fill_deferred(inputs["input_ids"], batch, pairs)
        if batch.overlap is not None:
            self.num_moved += len(batch.overlap.rows)
            fix_overlap(inputs, batch, self.block_size)
            slots = inputs["slot_mapping"].tolist()
            for row in batch.overlap.rows:  # the slot the runner computed is the one the position gives
                position = int(inputs["positions"][row])
                assert slots[row] == self._slot(batch.block_tables[row], position)
        batch = BatchInput(inputs["input_ids"].tolist(), inputs["positions"].tolist(), batch.query_lens,
                           inputs["seq_lens"].tolist(), batch.block_tables, batch.logits_indices,
                           batch.block_table_array)
        return super().execute(batch)
