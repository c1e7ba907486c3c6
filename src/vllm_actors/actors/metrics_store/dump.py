"""The content of an event-log dump: one JSON line per retained event (``event_json_line``).

Pure: the store hands a ``DumpContent`` to its shell, which writes it to a file of its choosing in
the run directory and replies with a ``DumpReply``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from vllm_actors.actors.metrics_store.event_log import LogRow
from vllm_actors.protocol.metrics import event_json_line


def dump_lines(rows: Iterable[LogRow]) -> Iterator[str]:
    """The dump's lines, without their newlines."""
    for actor, seq, mono, wall, event in rows:
        yield event_json_line(actor, seq, mono, wall, event)


@dataclass(frozen=True, slots=True)
class DumpContent:
    """A ``DumpQuery``'s answer before it is written: the retained events at the time of the query."""

    rows: tuple[LogRow, ...]

    @property
    def num_events(self) -> int:
        return len(self.rows)

    def lines(self) -> Iterator[str]:
        return dump_lines(self.rows)
