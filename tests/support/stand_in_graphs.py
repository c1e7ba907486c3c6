"""A captured decode graph's stand-in on the CPU (tests and CPU benchmarks of the graphs' input path)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_actors.runner.graph_inputs import DecodeGraph


class EagerReplay:
    """A decode graph's stand-in: ``replay`` runs the bucket's pass on the static inputs (its graph's output)."""

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self.run = run
        self.graph: DecodeGraph | None = None

    def replay(self) -> None:
        assert self.graph is not None
        self.graph.logits = self.run()
