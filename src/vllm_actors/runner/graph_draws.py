"""Which decode graph a step replays, and the steps whose tokens are drawn inside it.

A decode step (one new token per sequence) replays the graph of the next batch-size bucket; a
verification step of speculative decoding does too, as one decode row per token
(``verify_rows.as_decode_rows``). Where every row needs nothing but the fused sampling kernel
(``Sampler.graph_params``), a second graph per bucket up to ``max_num_seqs`` rows draws the tokens
in the same replay (``execute_sampled``): for a verification step each row keyed as the eager
sampler keys it (a seeded row by (seed, its own output index), ``verify.expand_rows``), so the draws
and the drafts they accept are the eager path's. ``ModelRunner`` mixes this in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_actors.actors.worker.step_data import BatchInput, GraphSampling
from vllm_actors.kernels.decode_splits import decode_graph_falls_short
from vllm_actors.runner.graph_inputs import DecodeGraph, GraphInputs
from vllm_actors.runner.verify_rows import as_decode_rows

if TYPE_CHECKING:
    from vllm_actors.lora.manager import LoRAManager


class GraphDraws:
    """The decode-graph choice of ``ModelRunner``'s steps, and its sampled execute path."""

    if TYPE_CHECKING:  # provided by ModelRunner
        _graphs: dict[int, DecodeGraph]
        _sampled_graphs: dict[int, DecodeGraph]
        _graph_sizes: list[int]
        _static: GraphInputs | None
        _weight_bytes: int
        _calculate_kv_scales: bool
        block_size: int
        max_model_len: int
        device: torch.device
        local_config: Any  # the model's config as this rank holds it (its KV heads)

        @property
        def bytes_per_block(self) -> int: ...

        lora: LoRAManager | None

        def _run_graph(self, batch: BatchInput, bucket: int,
                       sampling: GraphSampling | None = None) -> torch.Tensor: ...

    # the last step asked about (``samples_in_graph``) and its graph: its execute call takes it
    _asked: tuple[BatchInput, int | None, BatchInput] | None = None

    def _decode_bucket(self, batch: BatchInput) -> int | None:
        if not batch.is_decode or not self._graphs:
            return None
        size = next((size for size in self._graph_sizes if size >= len(batch.query_lens)), None)
        if size is not None and decode_graph_falls_short(batch.seq_lens, size, self.local_config.num_key_value_heads,
                                                         self.max_model_len, self.device):
            return None  # a long context among short ones: eagerly, split for its own lengths
        return size

    def _graph_step(self, batch: BatchInput) -> tuple[int | None, BatchInput]:
        """The decode graph's bucket for this step (None: no graph) and the batch it replays (a
        verification step's decode rows), once per step: ``samples_in_graph`` keeps its answer for
        the execute call that follows."""
        asked, self._asked = self._asked, None
        if asked is not None and asked[0] is batch:
            return asked[1], asked[2]
        bucket = self._decode_bucket(batch)
        if bucket is None and self._graphs:  # a verification step as decode rows (verify_rows.py)
            rows = as_decode_rows(batch, self.bytes_per_block / self.block_size, self._weight_bytes,
                                  self._static.queries_per_read if self._static else 1)
            if rows is not None:
                return self._decode_bucket(rows), rows
        return bucket, batch

    def samples_in_graph(self, batch: BatchInput) -> bool:
        """Whether ``execute_sampled`` can run this step: a decode or verification step whose rows
        fit a graph that samples (at most ``max_num_seqs`` rows)."""
        if self._calculate_kv_scales or not self._sampled_graphs or batch.eager:
            return False
        bucket, rows = self._graph_step(batch)
        self._asked = (batch, bucket, rows)
        return bucket is not None and bucket in self._sampled_graphs

    @torch.inference_mode()
    def execute_sampled(self, batch: BatchInput, sampling: GraphSampling) -> torch.Tensor:
        """Run a decode or verification step and draw its tokens (a row each, ``sampling``'s) in one
        graph replay (``samples_in_graph`` first); return the chosen ids on the device (a view of the
        graph's output: read, or copy, before the next step)."""
        bucket, rows = self._graph_step(batch)
        assert bucket is not None and bucket in self._sampled_graphs
        if self.lora is not None:
            self.lora.prepare(batch.loras, batch.query_lens)
        return self._run_graph(rows, bucket, sampling)
