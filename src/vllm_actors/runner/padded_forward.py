"""Whole forward passes of prefill and mixed steps in CUDA graphs, over padded static inputs.

A step that is not pure decode (a prefill chunk, or prefills with decodes mixed in) would run
eagerly: hundreds of kernel launches from Python for little GPU work. Here such a step is padded to
the next of a few token counts (``PADDED_TOKENS``) and to ``max_num_seqs`` sequences, and replays a
graph captured for that count:

- padded tokens have id 0, position 0 and cache slot -1 (the KV write skips them); they belong to
  no sequence, so attention leaves their rows alone and no real row reads them (every other op
  is row-wise);
- padded sequences have no query tokens and an empty context: the varlen attention kernel's
  programs for them return at once;
- the varlen kernel reads query starts, lengths and block tables from the device, so one graph
  serves every mix of lengths that fits; its tile shape is the one picked for the padded count.

Logits are computed outside the graph from the rows asked for. ``run`` without a captured graph
executes the same padded inputs eagerly: the tests compare it with the unpadded pass on a CPU.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.envs import envs
from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.runner.deferred_inputs import fill_deferred
from vllm_actors.runner.step_inputs import StepStaging

PADDED_TOKENS = [16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def padded_graphs_enabled() -> bool:
    """VLLM_ACTORS_PADDED_GRAPHS=0 runs prefill and mixed steps eagerly (as before)."""
    return envs.VLLM_ACTORS_PADDED_GRAPHS


class _Runner(Protocol):
    """What the padded pass reads of its ``ModelRunner``: the model, its KV cache and staging."""

    device: torch.device
    block_size: int
    max_blocks_per_seq: int
    max_model_len: int
    model: Any
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    _staging: StepStaging

    def _host_inputs(self, batch: BatchInput, rows: int, width: int) -> dict[str, torch.Tensor]: ...


class PaddedForward:
    def __init__(self, runner: _Runner, max_num_tokens: int, max_num_seqs: int) -> None:
        self.runner = runner
        self.sizes = sorted({size for size in PADDED_TOKENS if size < max_num_tokens} | {max_num_tokens})
        self.max_num_seqs = max_num_seqs
        device = runner.device
        largest = self.sizes[-1]
        self.width = runner.max_blocks_per_seq
        self.static = {
            "input_ids": torch.zeros(largest, dtype=torch.long, device=device),
            "positions": torch.zeros(largest, dtype=torch.long, device=device),
            "slot_mapping": torch.full((largest,), -1, dtype=torch.long, device=device),
            "query_start_loc": torch.zeros(max_num_seqs + 1, dtype=torch.int32, device=device),
            "seq_lens": torch.zeros(max_num_seqs, dtype=torch.int32, device=device),
            "block_tables": torch.zeros((max_num_seqs, self.width), dtype=torch.int32, device=device),
        }
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, batch: BatchInput) -> int | None:
        """The padded token count for this step, None when it does not fit."""
        num_tokens = len(batch.token_ids)
        if len(batch.query_lens) > self.max_num_seqs or max(batch.seq_lens) > self.width * self.runner.block_size:
            return None
        return next((size for size in self.sizes if size >= num_tokens), None)

    def _meta(self, size: int) -> AttentionMetadata:
        seqs = self.max_num_seqs
        return AttentionMetadata(
            slot_mapping=self.static["slot_mapping"][:size],
            query_start_loc=self.static["query_start_loc"],
            seq_lens=self.static["seq_lens"],
            block_tables=self.static["block_tables"],
            max_query_len=size,  # picks the tile shape: any shape is right for any lengths
            max_seq_len=self.runner.max_model_len,
            query_lens_cpu=[size] + [0] * (seqs - 1),  # host copies: read by the torch backend only
            seq_lens_cpu=[size] + [0] * (seqs - 1),
        )

    def _forward(self, size: int) -> torch.Tensor:
        runner = self.runner
        return runner.model(
            self.static["input_ids"][:size], self.static["positions"][:size], self._meta(size), runner.kv_caches
        )

    def _fill(self, batch: BatchInput, size: int) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, padding as the module docstring says;
        return the logits rows' index on the device (copied from the same staging set)."""
        num_tokens = len(batch.token_ids)
        num_seqs = len(batch.query_lens)
        host = self.runner._host_inputs(batch, num_seqs, self.width)
        static = self.static
        device = self.runner.device
        for name in ("input_ids", "positions", "slot_mapping"):
            static[name][:num_tokens].copy_(host[name], non_blocking=True)
        static["query_start_loc"][: num_seqs + 1].copy_(host["query_start_loc"], non_blocking=True)
        static["seq_lens"][:num_seqs].copy_(host["seq_lens"], non_blocking=True)
        static["block_tables"][:num_seqs].copy_(host["block_tables"], non_blocking=True)
        index = host["logits_indices"].to(device, non_blocking=True)
        deferred = host["deferred"].to(device, non_blocking=True) if "deferred" in host else None
        self.runner._staging.enqueued()  # the last copy out of the staging set: it may be refilled once this has run
        if deferred is not None:  # ids the previous step sampled, still on the device
            fill_deferred(static["input_ids"], batch, deferred)
        if size > num_tokens:
            static["input_ids"][num_tokens:size].zero_()
            static["positions"][num_tokens:size].zero_()
            static["slot_mapping"][num_tokens:size].fill_(-1)
        if self.max_num_seqs > num_seqs:
            static["query_start_loc"][num_seqs + 1 :].fill_(num_tokens)
            static["seq_lens"][num_seqs:].zero_()
        return index

    def run(self, batch: BatchInput, size: int) -> torch.Tensor:
        """Logits of ``batch.logits_indices`` (the model's dtype): the captured graph for ``size`` replayed, or
        (none captured) the same padded pass run eagerly."""
        index = self._fill(batch, size)
        if size in self.graphs:
            graph, hidden = self.graphs[size]
            graph.replay()
        else:
            hidden = self._forward(size)
        return self.runner.model.compute_logits(hidden.index_select(0, index))

    def capture(self, pool: Any, stream: torch.cuda.Stream) -> None:
        """One graph per padded size, largest first (the shared pool grows once)."""
        device = self.runner.device
        static = self.static
        with torch.inference_mode():
            for size in sorted(self.sizes, reverse=True):
                # a valid batch to record: sequences as long as a table allows, holding every
                # token (slots -1: nothing is written to the KV cache)
                longest = self.width * self.runner.block_size
                count = math.ceil(size / longest)
                if count > self.max_num_seqs:
                    continue
                lengths = [min(longest, size - i * longest) for i in range(count)]
                starts = [0]
                for length in lengths:
                    starts.append(starts[-1] + length)
                static["query_start_loc"].fill_(size)
                static["query_start_loc"][: count + 1] = torch.tensor(starts, dtype=torch.int32)
                static["seq_lens"].zero_()
                static["seq_lens"][:count] = torch.tensor(lengths, dtype=torch.int32)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm up (Triton compilation, lazy init) outside the graph
                        self._forward(size)
                torch.cuda.current_stream(device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden = self._forward(size)
                self.graphs[size] = (graph, hidden)
