"""Per-request records: the timeline entries and latency stamps the store keeps for one request.

Clocks: ``mono`` orders one actor's events, ``wall`` compares actors. A duration between two
stamps of the same actor uses ``mono``; across actors (ARRIVED comes from the frontend, FIRST_TOKEN
from the scheduler) it uses ``wall``. Negative durations (clock skew) are clamped to zero.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

from vllm_actors.protocol.events import Event, Tokens

Stamp = tuple[str, float, float]  # (actor, mono, wall) of the batch an event came in
# (global index of the event, actor, seq, mono, wall, event)
Entry = tuple[int, str, int, float, float, Event]


def elapsed(start: Stamp, end: Stamp) -> float:
    """Seconds from start to end: mono within one actor, wall across actors; never negative."""
    seconds = end[1] - start[1] if start[0] == end[0] else end[2] - start[2]
    return max(seconds, 0.0)


class TokenLog:
    """A request's TOKENS entries, compact: a long generation makes thousands of them, and
    keeping the shared TOKENS events themselves would keep every request's ids alive."""

    __slots__ = ("actor", "count", "index", "mono", "seq", "step", "wall")

    def __init__(self) -> None:
        self.index = array("q")
        self.actor: list[str] = []
        self.seq = array("q")
        self.mono = array("d")
        self.wall = array("d")
        self.step = array("q")
        self.count = array("q")  # the request's output length after the step (-1: not given)

    def __len__(self) -> int:
        return len(self.index)

    def append(self, index: int, actor: str, seq: int, mono: float, wall: float, step: int, count: int) -> None:
        self.index.append(index)
        self.actor.append(actor)
        self.seq.append(seq)
        self.mono.append(mono)
        self.wall.append(wall)
        self.step.append(step)
        self.count.append(count)

    def entries(self, request_id: str) -> Iterator[Entry]:
        for row in range(len(self.index)):
            count = self.count[row]
            event = Tokens(step_id=self.step[row], request_ids=[request_id],
                           num_output_tokens=[count] if count >= 0 else [])
            yield self.index[row], self.actor[row], self.seq[row], self.mono[row], self.wall[row], event


class RequestState(str, enum.Enum):
    NEW = "new"  # seen only through events that do not tell its state (joined late)
    ARRIVED = "arrived"
    WAITING = "waiting"
    RUNNING = "running"
    LOST = "lost"  # was live when the actor that scheduled it restarted (until it resumes, if it does)
    FINISHED = "finished"
    ABORTED = "aborted"


ENDED = (RequestState.FINISHED, RequestState.ABORTED)


@dataclass(slots=True, eq=False)
class RequestRecord:
    request_id: str
    entries: list[Entry] = field(default_factory=list)  # every event but TOKENS
    tokens: TokenLog = field(default_factory=TokenLog)
    dropped: int = 0
    state: RequestState = RequestState.NEW
    owner: str | None = None  # the actor that last set WAITING / RUNNING
    arrived: Stamp | None = None
    queued: Stamp | None = None
    scheduled: Stamp | None = None
    first_token: Stamp | None = None
    last_token: Stamp | None = None
    num_output_tokens: int | None = None  # None: unknown (the store joined after its start)
    prompt_counted: bool = False
    num_prompt_tokens: int | None = None  # from ARRIVED
    cached_at_admission: int | None = None  # SCHEDULED's num_cached_tokens (its first admission)
    sources_counted: bool = False  # its prompt tokens counted as computed / cached
    itl: list[float] = field(default_factory=list)
    interrupted: bool = False  # was live when its scheduler restarted
    lost: bool = False  # counted lost (ended with an error, never finished)
    nbytes: int = 0  # estimated bytes it holds (see ``RequestTable``)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def take_prompt_sources(self) -> tuple[int, int] | None:
        """Its prompt tokens as (computed, cached), once both its prompt length (ARRIVED) and its
        first admission (SCHEDULED) are known (two actors' events, in either order); None before
        and after that once: counted once, the counters only grow."""
        if self.sources_counted or self.num_prompt_tokens is None or self.cached_at_admission is None:
            return None
        self.sources_counted = True
        cached = min(self.cached_at_admission, self.num_prompt_tokens)
        return self.num_prompt_tokens - cached, cached

    def all_entries(self) -> Iterator[Entry]:
        """Its timeline entries, TOKENS included (not in index order: sort them)."""
        yield from self.entries
        yield from self.tokens.entries(self.request_id)


def new_tokens(record: RequestRecord, count: int | None) -> int:
    """Tokens a TOKENS entry adds: the growth of the request's output length."""
    if count is None:
        return 1
    previous = record.num_output_tokens
    if previous is None:  # joined late: the earlier outputs were never reported here
        record.num_output_tokens = count
        return 1
    if count <= previous:
        return 0
    record.num_output_tokens = count
    return count - previous
