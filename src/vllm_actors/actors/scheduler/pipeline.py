"""The step pipeline as the scheduler sees it: the plans sent whose results are not back (at most
``depth``, oldest first, each with the ids of the requests it samples), the step ids, the requests
that left the worker since the last plan, and the pipeline reset.

Results come back in plan order, so each one is matched to the oldest plan in flight. A reset
(after a restart elsewhere in the group, or a new scheduler's start; see ``recovery``) forgets
every plan in flight; the next plan carries ``reset=True``. Until that plan's result (its step id,
``StepResult.reset``) is back every other result is stale, as is any result of a lower step id
afterwards: a dead actor's plans still in the pipeline are never taken for this one's. A rejoin
(a KV-parallel rank restarted alone) forgets the plans in flight alike, keeping the departures; the
next plan carries the ``KvRejoin`` and its result is taken as a reset plan's.
"""

from __future__ import annotations

from collections import deque

from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.messages import KvRejoin, StepPlan, StepResult


class StepPipeline:
    def __init__(self, first_step_id: int, depth: int) -> None:
        """``first_step_id``: the step id of the first plan; ``depth``: the most plans in flight."""
        self.depth = depth
        self._in_flight: deque[tuple[StepPlan, list[str]]] = deque()
        self._departed: list[str] = []  # left the worker since the last plan
        self._next_step_id = first_step_id
        # The next plan resets the pipeline (a new scheduler's first one does); once sent, its
        # step id until its result is back; results of step ids below the last reset are stale.
        self._reset_pending = True
        self._reset_step: int | None = None
        self._min_step_id = first_step_id
        self._rejoin: KvRejoin | None = None  # the next plan carries it

    # ------------------------------------------------------------------ queries
    @property
    def next_step_id(self) -> int:
        """The step id of the next plan (events of the planning pass carry it)."""
        return self._next_step_id

    @property
    def reset_pending(self) -> bool:
        """The next plan resets the pipeline (sent even if it schedules nothing)."""
        return self._reset_pending

    @property
    def departed(self) -> tuple[str, ...]:
        """The requests the next plan tells the KV-cache manager and the workers to drop."""
        return tuple(self._departed)

    @property
    def is_full(self) -> bool:
        return len(self._in_flight) >= self.depth

    @property
    def rejoin_pending(self) -> bool:
        """The next plan carries a KV-parallel rank's rejoin (the running requests as its snapshot holds them)."""
        return self._rejoin is not None

    @property
    def has_news(self) -> bool:
        """The next plan has something to say even with no request to run."""
        return bool(self._departed) or self._reset_pending or self._rejoin is not None

    def __len__(self) -> int:
        return len(self._in_flight)

    @property
    def num_decoding(self) -> int:
        """The plans in flight that decode (a row of one token): pipeline stages' decode micro-batches."""
        return sum(1 for plan, _ in self._in_flight if 1 in plan.num_tokens)

    # ------------------------------------------------------------------ changes
    def depart(self, request_id: str) -> None:
        """The request leaves the worker: the next plan says so."""
        self._departed.append(request_id)

    def take_departed(self) -> list[str]:
        departed, self._departed = self._departed, []
        return departed

    def sent(self, plan: StepPlan, sampling_ids: list[str]) -> None:
        """``plan`` goes out (it samples a token for each of ``sampling_ids``)."""
        if plan.reset or plan.kv_rejoin is not None:
            self._reset_pending = False
            self._reset_step = self._min_step_id = plan.step_id
        self._in_flight.append((plan, sampling_ids))
        self._next_step_id += 1

    def is_stale(self, result: StepResult) -> bool:
        """A result of a plan sent before the last pipeline reset (or by a previous scheduler)."""
        if self._reset_pending or self._rejoin is not None:
            return True  # the reset (or rejoin) plan is not even sent: nothing in flight is ours
        if self._reset_step is not None:
            return not (result.reset and result.step_id == self._reset_step)
        return result.step_id < self._min_step_id

    def take_result(self, result: StepResult) -> tuple[StepPlan, list[str]] | None:
        """The plan ``result`` answers, with its sampling ids, no longer in flight; None for a stale
        result. Raises ``MessageRejected`` for a result that is not the oldest plan's."""
        if self.is_stale(result):
            return None
        if result.reset:
            self._reset_step = None  # the pipeline is ours again: results match plans in order
        if not self._in_flight or result.step_id != self._in_flight[0][0].step_id:
            raise MessageRejected(f"unexpected step result {result.step_id}")
        return self._in_flight.popleft()

    def reset(self) -> None:
        """What the pipeline held is gone: nothing in flight, the next plan resets it."""
        self._in_flight.clear()
        self._departed = []
        self._reset_pending = True
        self._reset_step = None
        self._rejoin = None

    def forget_in_flight(self) -> list[StepPlan]:
        """The plans in flight, forgotten (oldest first; their results will be stale), the
        departures kept: a KV-parallel rank restarted alone, ``rejoin`` follows."""
        plans = [plan for plan, _ in self._in_flight]
        self._in_flight.clear()
        return plans

    def rejoin(self, rejoin: KvRejoin) -> None:
        """The next plan carries ``rejoin``; every result until its own is stale."""
        self._rejoin = rejoin
        self._reset_step = None

    def take_rejoin(self) -> KvRejoin | None:
        rejoin, self._rejoin = self._rejoin, None
        return rejoin
