"""Pinned staging sets fenced against a device that lags (runner/staging.py): a set is handed out
again only after the fence recorded behind its copies has been waited on; its first use waits for
nothing. Fake fences stand in for CUDA events: they log each record and wait, and check at each
wait that the set still holds what its copies were enqueued from. The GPU test with real events
behind a busy device is tests/gpu/test_gpu_staging.py."""

from __future__ import annotations

import pytest
import torch

from vllm_actors.actors.worker.step_data import BatchInput
from vllm_actors.runner.graph_inputs import GraphInputs
from vllm_actors.runner.staging import StagingSets

CPU = torch.device("cpu")


class _Fence:
    def __init__(self, log: list[tuple[str, int]], index: int, watched: torch.Tensor | None) -> None:
        self.log, self.index, self.watched = log, index, watched
        self.enqueued_from: torch.Tensor | None = None

    def record(self) -> None:
        self.log.append(("record", self.index))
        if self.watched is not None:
            self.enqueued_from = self.watched.clone()

    def synchronize(self) -> None:
        self.log.append(("wait", self.index))
        if self.watched is not None:  # the set was not rewritten while its copy could still be queued
            assert self.enqueued_from is not None and torch.equal(self.watched, self.enqueued_from)


class _Fences:
    """The fence factory: fence i (made at set i's first ``enqueued``) watches ``watched[i]``."""

    def __init__(self, watched: list[torch.Tensor] | None = None) -> None:
        self.log: list[tuple[str, int]] = []
        self.watched = watched
        self.made = 0

    def __call__(self) -> _Fence:
        fence = _Fence(self.log, self.made, self.watched[self.made] if self.watched else None)
        self.made += 1
        return fence

    def count(self, kind: str) -> int:
        return sum(1 for entry, _ in self.log if entry == kind)


def test_a_set_is_rewritten_only_after_its_fence_is_waited_on_and_first_uses_wait_for_nothing() -> None:
    buffers = [torch.zeros(4), torch.zeros(4)]
    made = iter(buffers)
    fences = _Fences(buffers)
    sets = StagingSets(lambda: next(made), CPU, fences)
    for step in range(5):
        host = sets.acquire()
        index = next(i for i, buffer in enumerate(buffers) if buffer is host)
        fences.log.append(("write", index))
        host.fill_(step)
        sets.enqueued()
    assert fences.log == [
        ("write", 0), ("record", 0),
        ("write", 1), ("record", 1),
        ("wait", 0), ("write", 0), ("record", 0),
        ("wait", 1), ("write", 1), ("record", 1),
        ("wait", 0), ("write", 0), ("record", 0),
    ]


def test_a_caller_that_does_not_say_its_copies_are_enqueued_is_fenced_at_the_next_acquire() -> None:
    fences = _Fences()
    sets = StagingSets(lambda: torch.zeros(1), CPU, fences)
    for _ in range(3):
        sets.acquire()
    assert fences.log == [("record", 0), ("record", 1), ("wait", 0)]


def test_on_the_cpu_nothing_is_fenced_and_the_sets_take_turns() -> None:
    sets = StagingSets(lambda: torch.zeros(1), CPU)
    first, second = sets.acquire(), sets.acquire()
    sets.enqueued()
    assert first is not second and sets.acquire() is first
    one = StagingSets(lambda: torch.zeros(1), CPU, count=1)
    assert one.acquire() is one.acquire()
    with pytest.raises(ValueError, match="at least one set"):
        StagingSets(lambda: torch.zeros(1), CPU, count=0)


def test_decode_graph_inputs_wait_for_a_sets_copy_before_refilling_it() -> None:
    fences = _Fences()
    inputs = GraphInputs(4, 2, 4, CPU, fence=fences)
    for step in range(4):
        batch = BatchInput(token_ids=[step, step], positions=[step, step], query_lens=[1, 1],
                           seq_lens=[step + 1, step + 1], block_tables=[[0], [1]], logits_indices=[0, 1])
        inputs.upload(batch, 2, None)
        assert (fences.count("record"), fences.count("wait")) == (step + 1, max(step - 1, 0))
        assert inputs.device["input_ids"][:2].tolist() == [step, step]
    assert fences.log == [("record", 0), ("record", 1), ("wait", 0), ("record", 0), ("wait", 1), ("record", 1)]
