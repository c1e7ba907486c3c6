"""What the worker knows of tensor parallelism: its rank, and the broadcast of rank 0's sampled ids
(the runner's ``models.parallel.TensorParallel``; ``SingleRank`` without a group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class Ranks(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def enabled(self) -> bool: ...

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor: ...


@dataclass(frozen=True)
class SingleRank:
    """No tensor parallelism: rank 0 of 1."""

    rank: int = 0
    size: int = 1
    enabled: bool = False

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x


class Stage(Protocol):
    """The worker's pipeline stage (``models.pipeline.PipelineStage``): only the last one samples."""

    @property
    def stage(self) -> int: ...

    @property
    def is_last(self) -> bool: ...

    @property
    def enabled(self) -> bool: ...  # a pipeline of more than one stage


@dataclass(frozen=True)
class OnlyStage:
    """No pipeline: the one stage, first and last (tests give other values)."""

    stage: int = 0
    is_last: bool = True
    enabled: bool = False
