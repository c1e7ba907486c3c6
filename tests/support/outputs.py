"""An actor's ``Outputs`` as the (destination, message) pairs older tests read, events addressed to ``BUS``."""

from __future__ import annotations

from typing import Any

from vllm_actors.protocol.names import BUS
from vllm_actors.protocol.outputs import Outputs


def pairs(out: Outputs) -> list[tuple[str, Any]]:
    return [*out.messages, *((BUS, event) for event in out.events)]
