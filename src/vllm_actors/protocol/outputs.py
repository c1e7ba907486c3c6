"""What one handling of a message produces: messages for named peers and events for the bus.

Every actor's ``handle`` returns an ``Outputs``; the shells (ZMQ or in-process) send the messages
and publish the events as one stamped batch. Order is kept within each list."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Outputs:
    messages: list[tuple[str, Any]] = field(default_factory=list)  # (destination, message), in send order
    events: list[Any] = field(default_factory=list)

    def send(self, destination: str, message: Any) -> None:
        self.messages.append((destination, message))

    def emit(self, *events: Any) -> None:
        self.events.extend(events)

    def extend(self, other: Outputs) -> Outputs:
        self.messages.extend(other.messages)
        self.events.extend(other.events)
        return self

    def __iadd__(self, other: Outputs) -> Outputs:
        return self.extend(other)

    def __bool__(self) -> bool:
        return bool(self.messages or self.events)

    def to(self, destination: str) -> list[Any]:
        """The messages addressed to ``destination``, in order."""
        return [message for name, message in self.messages if name == destination]
