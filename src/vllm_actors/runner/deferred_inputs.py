"""Input ids that the previous step sampled and the host has not read yet, written into a step's
input ids on the device (``step_data.DeferredInputs``: a deferred step's placeholders)."""

from __future__ import annotations

import torch

from vllm_actors.actors.worker.step_data import BatchInput


def fill_deferred(input_ids: torch.Tensor, batch: BatchInput, pairs: torch.Tensor | None) -> None:
    """Write the previous step's sampled ids into their places (``pairs``: [2, k] on the device,
    flat indices over source rows)."""
    if batch.deferred is None or pairs is None:
        return
    input_ids.index_copy_(0, pairs[0], batch.deferred.source.index_select(0, pairs[1]))
