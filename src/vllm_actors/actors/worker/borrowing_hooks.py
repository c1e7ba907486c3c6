"""What the worker asks of borrowed KV across replicas (``runner/kv_borrowing.py`` holds it): the
plan's loans and guests applied after its membership changes, and each step's guests named (a step
with one runs eagerly: its attention calls out to the lenders)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from vllm_actors.protocol.messages import StepPlan

if TYPE_CHECKING:
    from vllm_actors.actors.worker.block_tables import BlockTableArray
    from vllm_actors.actors.worker.step_data import WorkerRequest


class BorrowingHooks(Protocol):
    def apply(self, plan: StepPlan, requests: Mapping[str, WorkerRequest], tables: BlockTableArray | None) -> None:
        ...

    def begin_step(self, req_ids: list[str]) -> bool:
        """Names the step's guests; True when it has one (its step must run eagerly)."""
        ...
