"""Each speculating request's drafting record (``Pace``), and the probes that keep its acceptance
measured while the plan drafts nothing for it.

A request that has not drafted for ``PROBE_INTERVAL`` of its steps probes with one draft; the
requests past half the interval probe in the same step (a batch's probes share one drafting step),
and only where that step's predicted extra cost (``DraftCost``: with a draft model, its catch-up
over the tokens since each request last drafted) is at most ``PROBE_SHARE`` of the seconds run
since anything was drafted. A probe whose drafts were all right lets its request probe again next
step, ``PROBE_STREAK`` times in a row at most, so text that becomes predictable earns its drafts
back as its acceptance climbs, where the streak could get there: the plan would draft for the
streaking requests with their acceptance as measured and a streak of right drafts more (a request
whose lookups find single drafts, right but in short runs, has many drafts measured, and a streak
of single right ones moves it little: its probes in a row were drafting steps at a loss). What
probing costs when drafts are never right: one drafted token per ``PROBE_INTERVAL // 2`` plain
steps of a request at most, and about ``PROBE_SHARE`` of the time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_actors.actors.scheduler.request import ScheduledRequest
from vllm_actors.actors.scheduler.spec_policy import Acceptance, DraftCost

PROBE_INTERVAL = 64  # a request that has not drafted for this many of its steps probes: one draft
PROBE_STREAK = 4  # right probes in a row after which it waits for the plan (or the next interval)
PROBE_SHARE = 0.01  # probes' predicted extra seconds over the seconds since the last drafting step


@dataclass
class Pace:
    """A request's drafting record."""

    acceptance: Acceptance = field(default_factory=Acceptance)
    idle: int = 0  # its steps planned without drafts since it last drafted
    drafted_at: int = 0  # its tokens when it last drafted (the drafter's KV reaches about there)
    catch_up: int = 0  # tokens its drafter catches up on in its step in flight
    streak: int = 0  # its drafting steps in a row with every draft right
    mark: int = 0  # the speculator's quiet passes when ``idle`` last counted them

    def drafting(self, num_tokens: int) -> None:
        """It drafts this step, with ``num_tokens`` tokens known."""
        self.idle, self.catch_up, self.drafted_at = 0, num_tokens - self.drafted_at, num_tokens

    def verified(self, num_drafted: int, num_accepted: int, num_planned: int = 0) -> None:
        self.acceptance.observe(num_drafted, num_accepted, num_planned)
        self.streak = self.streak + 1 if num_accepted == num_drafted else 0
        if 0 < self.streak <= PROBE_STREAK:  # all right: it may probe again next step
            self.idle = PROBE_INTERVAL


def choose_probers(candidates: Sequence[tuple[ScheduledRequest, Pace]], cost: DraftCost,
                   seconds_since_draft: float, fixed: float = 0.0,
                   streak_pays: Callable[[list[Pace]], bool] | None = None) -> set[str]:
    """The requests that probe this pass (one draft each, where the plan drafts none for them).
    ``fixed``: seconds a drafting step costs beyond ``cost`` (the overlap given up after it);
    ``streak_pays(paces)``: whether a streak of right drafts could bring the plan to draft for these
    requests (where it cannot, a right probe earns no next probe: its step is a loss)."""
    on_streak = [(request.request_id, pace) for request, pace in candidates
                 if 0 < pace.streak <= PROBE_STREAK and pace.idle >= PROBE_INTERVAL]
    streaking = {request_id for request_id, _ in on_streak}
    if streaking and streak_pays is not None and not streak_pays([pace for _, pace in on_streak]):
        streaking = set()
    if not any(pace.idle >= PROBE_INTERVAL and request.request_id not in streaking for request, pace in candidates):
        return streaking
    due = [(request, pace) for request, pace in candidates if pace.idle >= PROBE_INTERVAL // 2]
    catch_up = sum(request.num_tokens - pace.drafted_at for request, pace in due)
    if fixed + cost.seconds(1, len(due), catch_up) > PROBE_SHARE * seconds_since_draft:
        return streaking
    return streaking | {request.request_id for request, _ in due}
