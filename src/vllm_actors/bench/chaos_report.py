"""The chaos run's records and its report: what happened to each request and each fault.

Pure (no clock, no I/O): ``chaos.py`` records ``RequestRun``s, ``Fault``s and the supervisor's
``Restart`` events with their times; ``build_report`` classifies and counts them, ``format_table``
prints the report.

A request is, in this order of precedence:

* hung: no output for ``hang_timeout`` seconds (the tool gave up on it and aborted it);
* failed: it ended with finish reason "error", or its stream raised;
* completed: it finished with "stop" or "length" - and recovered when a fault fell between its
  submission and its end;
* lost: it never finished (still open when the run's drain deadline passed, or its stream ended
  without a final output).

A completed request differs when its tokens are not the fault-free reference run's for the same
prompt (greedy and seeded sampling give the same tokens, also across a recompute).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

COMPLETED_REASONS = ("stop", "length")
OUTCOMES = ("completed", "failed", "hung", "lost")


@dataclass
class RequestRun:
    """One request of the load, as the tool saw it. Times: seconds on one monotonic clock."""

    request_id: str
    prompt_index: int
    start: float
    end: float | None = None
    last_progress: float | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    hung: bool = False

    @property
    def outcome(self) -> str:
        if self.hung:
            return "hung"
        if self.error is not None or self.finish_reason == "error":
            return "failed"
        if self.finish_reason in COMPLETED_REASONS:
            return "completed"
        return "lost"

    def spans(self, moment: float, until: float) -> bool:
        """Whether ``moment`` falls while the request was open (``until``: the end of an unended one)."""
        end = self.end if self.end is not None else until
        return self.start <= moment <= end


@dataclass
class Fault:
    """One signal sent: at ``at`` (monotonic seconds), to ``actor``'s process ``pid``."""

    actor: str
    pid: int
    signal: str  # "SIGKILL" or "SIGSTOP"
    at: float
    continued_after: float | None = None  # a SIGSTOP followed by SIGCONT after this long: no restart needed


@dataclass
class Restart:
    """An ACTOR_RESTARTED event from the supervisor, stamped ``at`` (its monotonic clock: same host)."""

    actor: str
    pid: int
    attempt: int
    seconds: float  # the supervisor's own measure: failure noticed to READY
    at: float


@dataclass
class FaultOutcome:
    actor: str
    signal: str
    at: float  # seconds since the load started
    pid: int
    recovered_after: float | None  # kill to ACTOR_RESTARTED, seconds (None: no restart seen)
    supervisor_seconds: float | None  # ACTOR_RESTARTED.seconds
    new_pid: int | None
    requests_spanning: int
    restart_expected: bool = True  # False: a SIGSTOP continued by the tool (a stall, not a death)


@dataclass
class Divergence:
    request_id: str
    prompt_index: int
    position: int  # first differing token position
    got: int | None
    expected: int | None
    num_tokens: int
    num_expected: int


@dataclass
class ChaosReport:
    duration: float
    requests: dict[str, int]  # total, completed, recovered, failed, hung, lost, differing
    output_tokens: int
    tokens_per_second: float
    faults: list[FaultOutcome]
    recovery_seconds: dict[str, float | int]  # count, mean, p50, max (kill to ACTOR_RESTARTED)
    unrecovered_faults: int  # faults that needed a restart (SIGKILL, a SIGSTOP never continued) and saw none
    kv_blocks_in_use_after_idle: int | None
    kv_blocks_total: int | None
    group_failed: str | None
    pipeline_resets: int
    divergences: list[Divergence]
    errors: dict[str, int]  # error messages of failed requests, counted
    restarts_seen: dict[str, int] = field(default_factory=dict)
    skipped_faults: int = 0  # drawn while the actor was down: no signal sent

    @property
    def clean(self) -> bool:
        """Nothing failed, hung, was lost or differs; every fault recovered; no block held; the group lives."""
        counts = self.requests
        return (counts["failed"] == counts["hung"] == counts["lost"] == counts["differing"] == 0
                and self.unrecovered_faults == 0 and not self.kv_blocks_in_use_after_idle
                and self.group_failed is None)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["clean"] = self.clean
        return data


def first_divergence(got: Sequence[int], expected: Sequence[int]) -> int | None:
    """The first position where the token lists differ (a length difference counts); None: equal."""
    for position, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            return position
    return None if len(got) == len(expected) else min(len(got), len(expected))


def summarize_seconds(values: Iterable[float]) -> dict[str, float | int]:
    ordered = sorted(value for value in values if math.isfinite(value))
    if not ordered:
        return {"count": 0, "mean": 0.0, "p50": 0.0, "max": 0.0}
    middle = len(ordered) // 2
    p50 = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {"count": len(ordered), "mean": sum(ordered) / len(ordered), "p50": p50, "max": ordered[-1]}


def match_restarts(faults: Sequence[Fault], restarts: Sequence[Restart]) -> list[Restart | None]:
    """Each fault's restart: the first ACTOR_RESTARTED of its actor at or after the fault that no
    earlier fault took (None: no restart seen)."""
    used: set[int] = set()
    matched: list[Restart | None] = []
    for fault in faults:
        found = None
        for index, restart in enumerate(restarts):
            if index not in used and restart.actor == fault.actor and restart.at >= fault.at:
                found = restart
                used.add(index)
                break
        matched.append(found)
    return matched


def build_report(
    runs: Sequence[RequestRun],
    faults: Sequence[Fault],
    restarts: Sequence[Restart],
    reference: dict[int, list[int]] | None,
    *,
    started: float,
    ended: float,
    kv_blocks_in_use: int | None = None,
    kv_blocks_total: int | None = None,
    group_failed: str | None = None,
    pipeline_resets: int = 0,
    skipped_faults: int = 0,
    max_divergences: int = 10,
) -> ChaosReport:
    """Classify every request, match each fault with its restart, count."""
    counts = {"total": len(runs), **{outcome: 0 for outcome in OUTCOMES}, "recovered": 0, "differing": 0}
    divergences: list[Divergence] = []
    errors: dict[str, int] = {}
    output_tokens = 0
    for run in runs:
        outcome = run.outcome
        counts[outcome] += 1
        if outcome == "failed":
            message = (run.error or f"finish reason {run.finish_reason}")[:200]
            errors[message] = errors.get(message, 0) + 1
        if outcome != "completed":
            continue
        output_tokens += len(run.token_ids)
        if any(run.spans(fault.at, ended) for fault in faults):
            counts["recovered"] += 1
        expected = None if reference is None else reference.get(run.prompt_index)
        if expected is None:
            continue
        position = first_divergence(run.token_ids, expected)
        if position is not None:
            counts["differing"] += 1
            if len(divergences) < max_divergences:
                divergences.append(Divergence(
                    request_id=run.request_id, prompt_index=run.prompt_index, position=position,
                    got=run.token_ids[position] if position < len(run.token_ids) else None,
                    expected=expected[position] if position < len(expected) else None,
                    num_tokens=len(run.token_ids), num_expected=len(expected),
                ))
    outcomes = []
    recoveries = []
    for fault, restart in zip(faults, match_restarts(faults, restarts)):
        recovered_after = None if restart is None else max(restart.at - fault.at, 0.0)
        if recovered_after is not None:
            recoveries.append(recovered_after)
        outcomes.append(FaultOutcome(
            actor=fault.actor, signal=fault.signal, at=fault.at - started, pid=fault.pid,
            recovered_after=recovered_after, supervisor_seconds=None if restart is None else restart.seconds,
            new_pid=None if restart is None else restart.pid,
            requests_spanning=sum(run.spans(fault.at, ended) for run in runs),
            restart_expected=fault.continued_after is None,
        ))
    restarts_seen: dict[str, int] = {}
    for restart in restarts:
        restarts_seen[restart.actor] = restarts_seen.get(restart.actor, 0) + 1
    duration = max(ended - started, 1e-9)
    return ChaosReport(
        duration=duration,
        requests=counts,
        output_tokens=output_tokens,
        tokens_per_second=output_tokens / duration,
        faults=outcomes,
        recovery_seconds=summarize_seconds(recoveries),
        unrecovered_faults=sum(outcome.recovered_after is None and outcome.restart_expected for outcome in outcomes),
        kv_blocks_in_use_after_idle=kv_blocks_in_use,
        kv_blocks_total=kv_blocks_total,
        group_failed=group_failed,
        pipeline_resets=pipeline_resets,
        divergences=divergences,
        errors=errors,
        restarts_seen=restarts_seen,
        skipped_faults=skipped_faults,
    )


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(report: ChaosReport) -> str:
    """The readable report (multi-line, no trailing newline)."""
    counts = report.requests
    recovery = report.recovery_seconds
    kv = ("?" if report.kv_blocks_in_use_after_idle is None
          else f"{report.kv_blocks_in_use_after_idle}/{report.kv_blocks_total}")
    lines = [
        f"chaos run: {report.duration:.1f} s, {report.output_tokens} output tokens "
        f"({report.tokens_per_second:.1f} tok/s)",
        f"requests   {counts['total']} total: completed {counts['completed']} (recovered {counts['recovered']}), "
        f"failed {counts['failed']}, hung {counts['hung']}, lost {counts['lost']}; "
        f"differing from the reference {counts['differing']}",
        f"faults     {len(report.faults)}, unrecovered {report.unrecovered_faults}"
        + (f" ({report.skipped_faults} more drawn while the actor was down)" if report.skipped_faults else "")
        + ("; recovery (kill to ACTOR_RESTARTED) " + (
            f"mean {recovery['mean']:.2f} s, p50 {recovery['p50']:.2f} s, max {recovery['max']:.2f} s"
            if recovery["count"] else "never seen") if report.faults else ""),
        f"kv cache   {kv} blocks in use after idle (should be 0)",
        f"pipeline   {report.pipeline_resets} resets"
        + (f"; GROUP FAILED: {report.group_failed}" if report.group_failed else ""),
    ]
    if report.faults:
        lines.append(f"  {'at s':>7}  {'actor':<18} {'signal':<8} {'pid':>8} {'recovered s':>11} "
                     f"{'supervisor s':>12} {'new pid':>8} {'spanning':>8}")
        for fault in report.faults:
            kind = fault.signal if fault.restart_expected else "STALL"
            lines.append(f"  {fault.at:>7.2f}  {fault.actor:<18} {kind:<8} {fault.pid:>8} "
                         f"{_seconds(fault.recovered_after):>11} {_seconds(fault.supervisor_seconds):>12} "
                         f"{fault.new_pid if fault.new_pid is not None else '-':>8} {fault.requests_spanning:>8}")
    for message, count in sorted(report.errors.items(), key=lambda item: -item[1]):
        lines.append(f"  failed x{count}: {message}")
    for divergence in report.divergences:
        lines.append(f"  differs: {divergence.request_id} (prompt {divergence.prompt_index}) at token "
                     f"{divergence.position}: got {divergence.got}, expected {divergence.expected} "
                     f"({divergence.num_tokens} vs {divergence.num_expected} tokens)")
    lines.append("clean" if report.clean else "NOT CLEAN")
    return "\n".join(lines)
