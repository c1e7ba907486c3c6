"""A step's integer inputs on the host: token ids, positions, cache slots, query starts, lengths,
block tables, logits rows and deferred ids, filled into pinned buffers (on a GPU) for the eager and
padded passes to copy to the device without blocking. The two sets of buffers are ``StagingSets``:
a set is refilled only once the copies out of its previous use have run."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.runner.staging import Fence, StagingSets


class StepStaging:
    def __init__(self, device: torch.device, max_num_tokens: int, max_num_seqs: int, block_size: int,
                 width: int = 1, fence: Callable[[], Fence] | None = None) -> None:
        """Buffers for ``max_num_tokens`` tokens (plus padded decode rows) of ``max_num_seqs``
        sequences, block tables ``width`` blocks wide to start with (grown on demand)."""
        self.device = device
        self.max_num_tokens, self.max_num_seqs, self.block_size = max_num_tokens, max_num_seqs, block_size
        self.width = width
        self.sets = StagingSets(self._make, device, fence)

    def _make(self, width: int = 0) -> dict[str, torch.Tensor]:
        pin = self.device.type == "cuda"
        seqs, tokens = self.max_num_seqs, self.max_num_tokens + self.max_num_seqs

        def buffer(size: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, pin_memory=pin)

        return {
            "input_ids": buffer(tokens, torch.long),
            "positions": buffer(tokens, torch.long),
            "slot_mapping": buffer(tokens, torch.long),
            "query_start_loc": buffer(seqs + 1, torch.int32),
            "seq_lens": buffer(seqs, torch.int32),
            "logits_indices": buffer(tokens, torch.long),
            "block_tables": buffer((seqs, max(width, self.width)), torch.int32),
            "deferred": buffer((2, seqs), torch.long),
        }

    def enqueued(self) -> None:
        """Every copy out of the last ``fill``'s buffers is enqueued (``StagingSets.enqueued``)."""
        self.sets.enqueued()

    def fill(self, batch: BatchInput, rows: int, width: int) -> dict[str, torch.Tensor]:
        """Fill the next set; return host views of ``rows`` sequences (padded rows: sequence length
        1, slot -1) and block tables ``width`` blocks wide. Call ``enqueued`` once they are copied."""
        num_tokens = len(batch.token_ids)
        num_seqs = len(batch.query_lens)
        staging = self.sets.acquire()
        if staging["block_tables"].shape[1] < width or staging["input_ids"].shape[0] < num_tokens + rows:
            staging = self.sets.replace(self._make(width))
        positions = np.asarray(batch.positions, dtype=np.int64)
        query_lens = np.asarray(batch.query_lens, dtype=np.int64)
        sequence_of_token = np.repeat(np.arange(num_seqs), query_lens)
        blocks = batch.block_ids(sequence_of_token, positions // self.block_size)
        pad_tokens = rows - num_seqs if batch.is_decode else 0

        ids = staging["input_ids"].numpy()
        ids[:num_tokens] = batch.token_ids
        ids[num_tokens : num_tokens + pad_tokens] = 0
        pos = staging["positions"].numpy()
        pos[:num_tokens] = positions
        pos[num_tokens : num_tokens + pad_tokens] = 0
        slots = staging["slot_mapping"].numpy()
        slots[:num_tokens] = blocks * self.block_size + positions % self.block_size
        slots[num_tokens : num_tokens + pad_tokens] = -1
        start = staging["query_start_loc"].numpy()
        start[0] = 0
        start[1 : num_seqs + 1] = np.cumsum(query_lens)
        start[num_seqs + 1 : rows + 1] = start[num_seqs] + np.arange(1, rows - num_seqs + 1)
        lens = staging["seq_lens"].numpy()
        lens[:num_seqs] = batch.seq_lens
        lens[num_seqs:rows] = 1
        table_view = staging["block_tables"].numpy()
        used = batch.copy_tables(table_view, width)
        table_view[:num_seqs, used:width] = 0
        table_view[num_seqs:rows, :width] = 0
        index = staging["logits_indices"].numpy()
        index[: len(batch.logits_indices)] = batch.logits_indices
        total = num_tokens + pad_tokens
        deferred = {}
        if batch.deferred is not None:
            count = len(batch.deferred.flat_index)
            pairs = staging["deferred"].numpy()
            pairs[0, :count] = batch.deferred.flat_index
            pairs[1, :count] = batch.deferred.source_row
            deferred["deferred"] = staging["deferred"][:, :count]
        return {
            **deferred,
            "input_ids": staging["input_ids"][:total],
            "positions": staging["positions"][:total],
            "slot_mapping": staging["slot_mapping"][:total],
            "query_start_loc": staging["query_start_loc"][: rows + 1],
            "seq_lens": staging["seq_lens"][:rows],
            "block_tables": staging["block_tables"][:rows, :width],
            "logits_indices": staging["logits_indices"][: len(batch.logits_indices)],
        }

