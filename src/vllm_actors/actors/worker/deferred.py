"""A step launched but not yet read back: the worker's half of async scheduling.

A decode step's input is the token the previous step sampled. Waiting for that token on the host
before preparing the next step leaves the GPU idle for the whole host turn (read back, reply,
receive, prepare, launch): at batch 1 that is a third of every token's time. Instead the worker
launches step N+1 first, its input ids for the pending tokens taken from step N's sampled ids on
the device (``model_runner.DeferredInputs``), and only then reads step N's tokens back, while N+1
runs. vLLM's async scheduling does the same.

``PendingStep`` is one such step: its sampled ids on the device, their copy on its way to the host
(``HostCopies``: pinned buffers in turn, the copy ordered after the sampling on the stream), and
what its result needs. On a CPU the copy is the tensor itself and is ready at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vllm_actors.protocol.events import StepStarted

if TYPE_CHECKING:
    from vllm_actors.actors.worker.model_runner import BatchInput
    from vllm_actors.actors.worker.worker import WorkerRequest


def defer_steps() -> bool:
    """VLLM_ACTORS_DEFER_STEPS=0: workers read every step back before launching the next (the
    shells read this and hand it to ``Worker(defer=...)``)."""
    return os.environ.get("VLLM_ACTORS_DEFER_STEPS", "1") != "0"


def tp_graph_draws() -> bool:
    """VLLM_ACTORS_TP_GRAPH_SAMPLER (default 1): under tensor parallelism every rank draws a sampling
    decode graph's tokens itself (no eager sampler on rank 0, no broadcast); 0: rank 0 draws and
    broadcasts. On two H100s it gave 4.62 against 4.66 ms/token at batch 1 and 11,364 against
    11,335 tok/s; the GPU test of sampled rows (tests/test_gpu_tensor_parallel.py) passed on two
    H100s (2026-11-26, fifth session), as did greedy TP=2 equal to TP=1."""
    return os.environ.get("VLLM_ACTORS_TP_GRAPH_SAMPLER", "1") != "0"


@dataclass
class DeferredInputs:
    """Input ids still on the device: token ``flat_index[i]`` of the batch is ``source[source_row[i]]``
    (the ids the previous step sampled, not yet read back to the host)."""

    flat_index: list[int]
    source: torch.Tensor
    source_row: list[int]


def fill_deferred(input_ids: torch.Tensor, batch: BatchInput, pairs: torch.Tensor | None) -> None:
    """Write the previous step's sampled ids into their places (``pairs``: [2, k] on the device,
    flat indices over source rows)."""
    if batch.deferred is None or pairs is None:
        return
    input_ids.index_copy_(0, pairs[0], batch.deferred.source.index_select(0, pairs[1]))


@dataclass
class PendingStep:
    step_id: int
    started_at: float  # the worker's clock when the step was launched
    started: StepStarted
    samplers: list[WorkerRequest]  # the requests it sampled, in row order
    chosen: torch.Tensor  # [len(samplers)] token ids on the device
    host: torch.Tensor  # their copy on the host: valid once ``done`` is set or has completed
    done: torch.cuda.Event | None
    num_batched_tokens: int
    row_of: dict[str, int] = field(default_factory=dict)  # request id -> row in ``chosen``
    grammars_fed: bool = False  # its tokens went to the constrained requests' matchers

    def ready(self) -> bool:
        """Whether the tokens are on the host (reading them would not wait)."""
        return self.done is None or self.done.query()

    def token_ids(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class HostCopies:
    """Copies of sampled ids to the host without waiting: two pinned buffers and two events in
    turn (a step is read back before the step after next reuses its buffer and event; creating an
    event each step cost 7% of the worker's host time at batch 1)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event] = []
        self._turn = 0

    def start(self, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        if chosen.device.type != "cuda":
            return chosen, None
        size = chosen.shape[0]
        self._turn ^= 1
        if len(self._buffers) < 2 or self._buffers[self._turn].shape[0] < size:
            capacity = max(size, 256)
            self._buffers = [torch.empty(capacity, dtype=torch.long, pin_memory=True) for _ in range(2)]
        host = self._buffers[self._turn][:size]
        host.copy_(chosen, non_blocking=True)
        if not self._events:
            self._events = [torch.cuda.Event(), torch.cuda.Event()]
        done = self._events[self._turn]
        done.record()
        return host, done
