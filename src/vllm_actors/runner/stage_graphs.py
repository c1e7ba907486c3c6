"""Decode CUDA graphs of a pipeline stage: the point-to-point hand-over stays outside the graph.

A stage's decode graph runs its layers only. The first stage's reads the token ids (as without
a pipeline); a later stage's reads the previous stage's output and residual from a static
``[2, bucket, hidden]`` input, one buffer whose prefix each bucket views. A stage before the last
returns its ``[2, bucket, hidden]`` output instead of logits; the last computes logits (or draws
the tokens) as without a pipeline. Per step, around the replay:

- a later stage receives ``[2, T, hidden]`` for the step's T rows (the wire format of eager
  steps: a graph stage and an eager one understand each other) and copies it into the first T
  rows of the bucket's input (the padded rows keep finite values of earlier steps: they write
  no KV and no real row reads them);
- a stage before the last sends a copy of its output's first T rows: the graph's output buffer
  is overwritten by the next replay, possibly before the asynchronous send has read it.

Nothing here runs on the CPU: graphs are captured on CUDA devices only."""

from __future__ import annotations

import torch

from vllm_actors.models.pipeline import PipelineStage


class StageGraphIO:
    def __init__(self, stage: PipelineStage, largest: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.stage = stage
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self._intermediate = None if stage.is_first else \
            torch.zeros(2 * largest * hidden_size, dtype=dtype, device=device)

    def bucket_inputs(self, inputs: dict[str, torch.Tensor], size: int) -> dict[str, torch.Tensor]:
        """A bucket's graph inputs with its static ``intermediate`` view (a stage after the first)."""
        if self._intermediate is None:
            return inputs
        return {**inputs, "intermediate": self._intermediate_view(size)}

    def _intermediate_view(self, size: int) -> torch.Tensor:
        assert self._intermediate is not None
        return self._intermediate[: 2 * size * self.hidden_size].view(2, size, self.hidden_size)

    def replay(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor, size: int, num_rows: int) -> torch.Tensor:
        """One step of the stage through the graph of bucket ``size``: the logits of its
        ``num_rows`` rows on the last stage, an empty tensor before it (its output sent on)."""
        if not self.stage.is_first:
            received = self.stage.recv(num_rows, self.hidden_size, self.dtype, self.device)
            self._intermediate_view(size)[:, :num_rows].copy_(received)
        graph.replay()
        if self.stage.is_last:
            return output[:num_rows]
        sent = torch.empty((2, num_rows, self.hidden_size), dtype=output.dtype, device=output.device)
        sent.copy_(output[:, :num_rows])
        self.stage.send(sent)
        return torch.empty((0, 0), dtype=self.dtype, device=self.device)
