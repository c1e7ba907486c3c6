"""Per-actor sequence numbers of event batches: first batch, in order, gap, stale or restart.

Shared by the metrics store and the taps, so both count gaps the same way.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from vllm_actors.protocol.events import ActorStarting, EventBatch


class SeqVerdict(enum.Enum):
    FIRST = "first"  # first batch seen of the actor: sets the baseline
    IN_ORDER = "in_order"
    GAP = "gap"  # first_seq jumped past the expected one: events were lost
    STALE = "stale"  # first_seq went backwards: a duplicate or a late batch (its old events skipped)
    RESTART = "restart"  # the actor's sequence started over: a new baseline


@dataclass(frozen=True, slots=True)
class SeqCheck:
    verdict: SeqVerdict
    missed: int = 0  # events lost just before this batch (GAP)
    skip: int = 0  # leading events of this batch already seen (STALE)


class SequenceTracker:
    """Per actor, the next expected sequence number.

    The first batch of an actor sets its baseline (a subscriber may join mid-stream). A batch
    starting past the expected number is a gap. A batch starting before it is either a new
    incarnation of the actor - ``first_seq == 0`` opening with STARTING, or a batch stamped later
    (``mono`` greater: one incarnation stamps seq and mono together, so a lower seq with a later
    mono means the numbering started over) - or else stale: its already-seen events are skipped.
    """

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._mono: dict[str, float] = {}

    def expected(self, actor: str) -> int | None:
        return self._next.get(actor)

    def forget(self, actor: str) -> None:
        """Drop what is known of ``actor`` (its next batch sets a new baseline)."""
        self._next.pop(actor, None)
        self._mono.pop(actor, None)

    def check(self, batch: EventBatch) -> SeqCheck:
        """Classify the batch and advance the actor's expected number."""
        actor, first, count = batch.actor, batch.first_seq, len(batch.events)
        expected = self._next.get(actor)
        if expected is None:
            result = SeqCheck(SeqVerdict.FIRST)
        elif first == expected:
            result = SeqCheck(SeqVerdict.IN_ORDER)
        elif first > expected:
            result = SeqCheck(SeqVerdict.GAP, missed=first - expected)
        elif self._is_restart(batch, self._mono[actor]):
            result = SeqCheck(SeqVerdict.RESTART)
        else:
            self._next[actor] = max(expected, first + count)
            self._mono[actor] = max(self._mono[actor], batch.mono)
            return SeqCheck(SeqVerdict.STALE, skip=min(count, expected - first))
        self._next[actor] = first + count
        self._mono[actor] = batch.mono
        return result

    @staticmethod
    def _is_restart(batch: EventBatch, last_mono: float) -> bool:
        opens_with_starting = bool(batch.events) and isinstance(batch.events[0], ActorStarting)
        return (batch.first_seq == 0 and opens_with_starting) or batch.mono > last_mono
