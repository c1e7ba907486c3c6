"""The store's requests: open ones until they end, then the last ``max_finished`` ended ones.

Also the gauges that follow request states (running, waiting), the parent -> children index of
n>1 requests, and the cap on one request's timeline. Bounded: past ``max_open`` open requests the
oldest is dropped (counted in ``evicted``, and told in ``notices``). Bounded in bytes too: each
record's size is estimated as it grows (``nbytes``); ``trim``, after each batch, drops the oldest
ended records while the table is over ``max_bytes``. Open records are not dropped for bytes (they
would come back with their next event): while the table is still over, their timelines take no
more TOKENS rows nor bulk entries (ALLOCATED, PREFILL_CHUNK, BLOCK_CACHED), counted in ``dropped``.
"""

from __future__ import annotations

from vllm_actors.actors.metrics_store.notices import Notice, OpenRequestDropped
from vllm_actors.actors.metrics_store.records import RequestRecord, RequestState
from vllm_actors.protocol.events import Allocated, BlockCached, Event, PrefillChunk
from vllm_actors.protocol.names import CHILD_SEPARATOR, parent_request_id

# Over-long timelines drop their high-volume entries first; the rest get this much more room.
_BULK_TYPES = (Allocated, PrefillChunk, BlockCached)
_TIMELINE_RESERVE = 256

RECORD_BYTES = 1_024  # an empty record: its slots, its token log's arrays, its lists and sets
ENTRY_BYTES = 168  # a timeline entry's tuple, index, seq and stamps (its event comes on top)
TOKEN_ROW_BYTES = 64  # one row of a token log (six array items and the actor's slot)


class RequestTable:
    def __init__(self, max_open: int, max_finished: int, max_timeline_events: int, notices: list[Notice],
                 max_bytes: int = 1 << 62) -> None:
        self.max_open = max_open
        self.max_finished = max_finished
        self.max_timeline_events = max_timeline_events
        self.max_bytes = max_bytes
        self.nbytes = 0  # estimated bytes of every record, open and ended
        self.open: dict[str, RequestRecord] = {}  # insertion order: oldest first
        self.ended: dict[str, RequestRecord] = {}  # insertion order: oldest first
        self.children: dict[str, set[str]] = {}  # parent id -> child ids with a record
        self.running: set[str] = set()
        self.waiting: set[str] = set()
        self.evicted = 0  # open requests dropped to stay within max_open
        self._notices = notices

    # ------------------------------------------------------------------ lookup
    def find(self, request_id: str) -> RequestRecord | None:
        record = self.open.get(request_id)
        return record if record is not None else self.ended.get(request_id)

    def get(self, request_id: str) -> RequestRecord:
        """The request's record, opened if it has none."""
        record = self.find(request_id)
        if record is None:
            record = self.open[request_id] = RequestRecord(request_id, nbytes=RECORD_BYTES + len(request_id))
            self.nbytes += record.nbytes
            if CHILD_SEPARATOR in request_id:
                self.children.setdefault(parent_request_id(request_id), set()).add(request_id)
            if len(self.open) > self.max_open:
                self._evict_open()
        return record

    def children_of(self, request_id: str) -> list[RequestRecord]:
        """The records of the request's n>1 children, in child order."""
        records: list[RequestRecord] = []
        for child in sorted(self.children.get(request_id, ()), key=_child_order):
            record = self.find(child)
            if record is not None:
                records.append(record)
        return records

    def owned_by(self, actor: str) -> list[RequestRecord]:
        """Open requests ``actor`` had waiting or running."""
        return [record for record in self.open.values()
                if record.owner == actor and record.state in (RequestState.WAITING, RequestState.RUNNING)]

    # ------------------------------------------------------------------ timeline
    def add_entry(self, record: RequestRecord, index: int, actor: str, seq: int, mono: float, wall: float,
                  event: Event, event_bytes: int) -> None:
        """Put an event on the record's timeline (``event_bytes``: its estimated size)."""
        size = len(record.entries)
        if (size >= self.max_timeline_events or self.nbytes > self.max_bytes) and (
            isinstance(event, _BULK_TYPES) or size >= self.max_timeline_events + _TIMELINE_RESERVE
        ):
            record.dropped += 1
            return
        record.entries.append((index, actor, seq, mono, wall, event))
        added = ENTRY_BYTES + event_bytes
        record.nbytes += added
        self.nbytes += added

    # ------------------------------------------------------------------ states
    def set_state(self, record: RequestRecord, state: RequestState, actor: str) -> None:
        request_id = record.request_id
        if record.state is RequestState.RUNNING:
            self.running.discard(request_id)
        elif record.state is RequestState.WAITING:
            self.waiting.discard(request_id)
        record.state = state
        record.owner = actor
        if state is RequestState.RUNNING:
            self.running.add(request_id)
        elif state is RequestState.WAITING:
            self.waiting.add(request_id)

    def mark_running(self, record: RequestRecord, actor: str) -> None:
        """Work on a request (a prefill chunk, a token) shows it running, whatever was missed."""
        if record.state is not RequestState.RUNNING and not record.ended:
            self.set_state(record, RequestState.RUNNING, actor)

    def end(self, record: RequestRecord, state: RequestState, actor: str) -> None:
        self.set_state(record, state, actor)
        if self.open.pop(record.request_id, None) is None:
            return
        self.ended[record.request_id] = record
        while len(self.ended) > self.max_finished:
            self._evict_ended()

    # ------------------------------------------------------------------ bounds
    @property
    def full(self) -> bool:
        """Over ``max_bytes`` with nothing ended left to drop: timelines take no bulk entries."""
        return self.nbytes > self.max_bytes

    def trim(self) -> None:
        """Back within ``max_bytes`` if dropping the oldest ended records can do it."""
        while self.nbytes > self.max_bytes and self.ended:
            self._evict_ended()

    def _evict_ended(self) -> None:
        oldest = next(iter(self.ended.values()))
        del self.ended[oldest.request_id]
        self.nbytes -= oldest.nbytes
        self._forget_child(oldest.request_id)

    def _evict_open(self) -> None:
        oldest = next(iter(self.open.values()))
        del self.open[oldest.request_id]
        self.nbytes -= oldest.nbytes
        self.running.discard(oldest.request_id)
        self.waiting.discard(oldest.request_id)
        self._forget_child(oldest.request_id)
        self.evicted += 1
        self._notices.append(OpenRequestDropped(request_id=oldest.request_id, state=oldest.state.value))

    def _forget_child(self, request_id: str) -> None:
        if CHILD_SEPARATOR not in request_id:
            return
        parent = parent_request_id(request_id)
        children = self.children.get(parent)
        if children is not None:
            children.discard(request_id)
            if not children:
                del self.children[parent]


def _child_order(request_id: str) -> tuple[int, str]:
    suffix = request_id.rsplit(CHILD_SEPARATOR, 1)[1]
    return (int(suffix), "") if suffix.isdigit() else (1 << 62, suffix)
