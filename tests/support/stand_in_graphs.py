"""A captured decode graph's stand-in on the CPU (tests and CPU benchmarks of the graphs' input path)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_actors.kernels.attention import AttentionMetadata
from vllm_actors.runner.graph_inputs import DecodeGraph, GraphInputs
from vllm_actors.runner.model_runner import ModelRunner
from vllm_actors.runner.verify_rows import queries_per_read


class EagerReplay:
    """A decode graph's stand-in: ``replay`` runs the bucket's pass on the static inputs (its graph's output)."""

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self.run = run
        self.graph: DecodeGraph | None = None

    def replay(self) -> None:
        assert self.graph is not None
        self.graph.logits = self.run()


def stand_in_decode_graphs(runner: ModelRunner, sizes: list[int], sampled_sizes: list[int] | None = None) -> None:
    """``runner``'s decode graphs of ``sizes`` rows (and graphs that sample too, for ``sampled_sizes``)
    stood in for on the CPU, set up as ``capture_graphs`` does for a speculating runner (query groups
    read where the attention backend groups rows)."""
    runner._weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    runner._static = GraphInputs(sizes[-1], runner.max_blocks_per_seq, runner.block_size, runner.device,
                                 queries_per_read=queries_per_read(True, runner.model, runner.local_config))
    for size in sizes:
        inputs = runner._static.for_bucket(size)
        meta = runner._static.meta(inputs, size, runner.max_model_len)
        for sampled in (False, True) if size in (sampled_sizes or []) else (False,):
            def run(inputs: dict[str, torch.Tensor] = inputs, meta: AttentionMetadata = meta,
                    sampled: bool = sampled) -> torch.Tensor:
                return runner._decode_pass(inputs, meta, sampled)

            stand_in = EagerReplay(run)
            graphs = runner._sampled_graphs if sampled else runner._graphs
            stand_in.graph = graphs[size] = DecodeGraph(stand_in, torch.empty(0))  # type: ignore[arg-type]  # replay() only
    runner._graph_sizes = list(sizes)
