"""Input ids that the previous step sampled and the host has not read yet, written into a step's
input ids on the device (``step_data.DeferredInputs``: a deferred step's placeholders), and the
decode rows that follow a verification not read back yet, moved to where its accepted drafts put
them (``step_data.OverlapRows``; ``actors/worker/spec_overlap.py``)."""

from __future__ import annotations

import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.actors.worker.uploads import upload


def fill_deferred(input_ids: torch.Tensor, batch: BatchInput, pairs: torch.Tensor | None) -> None:
    """Write the previous step's sampled ids into their places (``pairs``: [2, k] on the device,
    flat indices over source rows)."""
    if batch.deferred is None or pairs is None:
        return
    input_ids.index_copy_(0, pairs[0], batch.deferred.source.index_select(0, pairs[1]))


def fix_overlap(inputs: dict[str, torch.Tensor], batch: BatchInput, block_size: int) -> None:
    """Each ``batch.overlap`` row moved back by its rejected drafts, on the device (index ops, no
    host sync): its position, KV slot (from its block table) and sequence length, and its input
    id the target's draw after its accepted drafts. ``inputs``: the step's device tensors
    ``input_ids``, ``positions``, ``slot_mapping``, ``seq_lens``, ``block_tables`` (a decode step:
    flat index = sequence index), after ``fill_deferred``."""
    fix = batch.overlap
    if fix is None:
        return
    device = inputs["input_ids"].device
    packed = upload(fix.rows + fix.first_row + fix.num_drafts + fix.which, device).view(4, len(fix.rows))
    rows, first, num_drafts, which = packed[0], packed[1], packed[2], packed[3]
    accepted = fix.accepted.index_select(0, which)
    shift = num_drafts - accepted
    positions = inputs["positions"].index_select(0, rows) - shift
    inputs["positions"].index_copy_(0, rows, positions)
    blocks = inputs["block_tables"][rows, torch.div(positions, block_size, rounding_mode="floor")].long()
    inputs["slot_mapping"].index_copy_(0, rows, blocks * block_size + positions % block_size)
    seq_lens = inputs["seq_lens"]
    seq_lens.index_copy_(0, rows, seq_lens.index_select(0, rows) - shift.to(seq_lens.dtype))
    inputs["input_ids"].index_copy_(0, rows, fix.source.index_select(0, first + accepted))
