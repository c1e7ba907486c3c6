"""The store's event log: the last events applied, bounded in number and in estimated bytes.

Each row is (actor, seq, mono, wall, event); its size is estimated once, on the way in
(``bounds.event_bytes`` plus the row's own objects). Past either bound the oldest rows go.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from vllm_actors.protocol.events import Event

# (actor, seq, mono, wall, event): one event of the log
LogRow = tuple[str, int, float, float, Event]

ROW_BYTES = 184  # the row's tuple, its seq and stamps, its slots in the deques


class EventLog:
    def __init__(self, max_events: int, max_bytes: int) -> None:
        if max_events < 1 or max_bytes < 1:
            raise ValueError(f"the event log's bounds must be at least 1, got {max_events}, {max_bytes}")
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.nbytes = 0  # estimated bytes of the rows retained
        self._rows: deque[LogRow] = deque()
        self._sizes: deque[int] = deque()

    def append(self, row: LogRow, event_bytes: int) -> None:
        """Retain a row (``event_bytes``: its event's estimated size), dropping the oldest rows
        past either bound (the newest row is always kept)."""
        size = ROW_BYTES + event_bytes
        rows, sizes = self._rows, self._sizes
        rows.append(row)
        sizes.append(size)
        self.nbytes += size
        while len(rows) > 1 and (len(rows) > self.max_events or self.nbytes > self.max_bytes):
            rows.popleft()
            self.nbytes -= sizes.popleft()

    def __len__(self) -> int:
        return len(self._rows)

    def __iter__(self) -> Iterator[LogRow]:
        return iter(self._rows)
