"""Checkpoint tensors by Hugging Face name, as the model's loader reads them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from vllm_actors.models.parallel import Part


class TensorSource(Protocol):
    """Checkpoint tensors by Hugging Face name, read whole or in part."""

    def names(self) -> Iterable[str]: ...

    def shape(self, name: str) -> list[int]: ...

    def read(self, name: str, part: Part | None) -> torch.Tensor: ...


class DictSource:
    """A state dict already in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def shape(self, name: str) -> list[int]:
        return list(self.tensors[name].shape)

    def read(self, name: str, part: Part | None) -> torch.Tensor:
        tensor = self.tensors[name]
        return tensor if part is None else tensor.narrow(part.dim, part.start, part.stop - part.start)
