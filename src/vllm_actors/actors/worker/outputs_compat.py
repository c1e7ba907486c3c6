"""The worker's ``Outputs``, also iterable as the ``(destination, message)`` pairs (events addressed
to ``BUS``) that the shells read before they took ``Outputs``: delete this module, and use
``Outputs`` in worker.py, once every shell calls ``Outputs.coerce``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vllm_actors.protocol.names import BUS
from vllm_actors.protocol.outputs import Outputs


class PairedOutputs(Outputs):
    def __iter__(self) -> Iterator[tuple[str, Any]]:
        yield from self.messages
        yield from ((BUS, event) for event in self.events)
