"""The soak's figures and verdict (pure: no sockets, clocks or files).

``Tally`` counts outcomes per kind of request; ``Sample`` is one minute's resident memory of every
process of the group plus the KV pool; ``build_report`` applies the criteria:

- every valid request answered (status 200 and a whole body: ``[DONE]`` for a stream);
- no response with a status >= 500 (in-band stream errors included) and none hung;
- the KV pool empty once the load stopped;
- each process's resident memory at the end within ``rss_tolerance`` (10%) of its value at the
  baseline minute (5; the first sample when the run is shorter).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

VALID_KINDS = ("completion", "chat", "clash_owner")


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0  # status 200 with a whole body
    by_status: dict[str, int] = field(default_factory=dict)
    server_errors: int = 0  # status >= 500, or a 5xx error event inside a stream
    hung: int = 0
    transport_errors: int = 0  # connection refused, reset or closed without an answer (not our disconnects)
    examples: list[str] = field(default_factory=list)  # a few failures, for the report

    def count(self, status: int | None, complete: bool, problem: str | None) -> None:
        self.sent += 1
        key = "none" if status is None else str(status)
        self.by_status[key] = self.by_status.get(key, 0) + 1
        if status == 200 and complete:
            self.answered += 1
        if problem == "hang":
            self.hung += 1
        elif problem == "transport":
            self.transport_errors += 1
        elif problem is not None:
            self.server_errors += 1


@dataclass
class Sample:
    minute: float
    rss_mb: dict[str, float]  # process name -> resident MB
    pids: dict[str, int]
    kv_blocks_in_use: int | None
    running: int | None
    waiting: int | None


@dataclass
class Criterion:
    name: str
    passed: bool
    detail: str


@dataclass
class SoakReport:
    minutes: float
    clients: int
    tallies: dict[str, Tally]
    samples: list[Sample]
    final: Sample | None
    baseline_minute: float
    criteria: list[Criterion]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.criteria)

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        body["passed"] = self.passed
        return body


def baseline_sample(samples: list[Sample], minute: float) -> Sample | None:
    """The first sample at or after ``minute``; the first one when none is that late."""
    if not samples:
        return None
    late = [s for s in samples if s.minute >= minute]
    return late[0] if late else samples[0]


def build_report(minutes: float, clients: int, tallies: dict[str, Tally], samples: list[Sample],
                 final: Sample | None, baseline_minute: float = 5.0, rss_tolerance: float = 0.10) -> SoakReport:
    criteria = []
    valid = [tallies[k] for k in VALID_KINDS if k in tallies]
    sent, answered = sum(t.sent for t in valid), sum(t.answered for t in valid)
    criteria.append(Criterion("every valid request answered", sent == answered and sent > 0,
                              f"{answered} of {sent}"))
    errors, total = sum(t.server_errors for t in tallies.values()), sum(t.sent for t in tallies.values())
    criteria.append(Criterion("no response >= 500", errors == 0, f"{errors} of {total}"))
    hung = sum(t.hung for t in tallies.values())
    criteria.append(Criterion("no request hung", hung == 0, f"{hung} hung"))
    in_use = None if final is None else final.kv_blocks_in_use
    criteria.append(Criterion("KV pool empty at the end", in_use == 0, f"{in_use} blocks in use"))
    base = baseline_sample(samples, baseline_minute)
    if base is None or final is None:
        criteria.append(Criterion("memory flat", False, "no samples"))
    else:
        for name in sorted(final.rss_mb):
            start, end = base.rss_mb.get(name), final.rss_mb[name]
            if start is None or start <= 0:
                criteria.append(Criterion(f"memory flat: {name}", False, f"no baseline (minute {base.minute:.1f})"))
                continue
            growth = end / start - 1.0
            restarted = base.pids.get(name) != final.pids.get(name)
            detail = (f"{start:.0f} MB at minute {base.minute:.1f} -> {end:.0f} MB ({growth:+.1%})"
                      + (" (restarted meanwhile)" if restarted else ""))
            criteria.append(Criterion(f"memory flat: {name}", abs(growth) <= rss_tolerance, detail))
    return SoakReport(minutes, clients, tallies, samples, final, baseline_minute, criteria)


def format_markdown(report: SoakReport) -> str:
    lines = [f"# Soak: {report.minutes:g} min, {report.clients} clients - {'PASS' if report.passed else 'FAIL'}", "",
             "| criterion | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {c.name} | {'ok' if c.passed else 'FAIL'} | {c.detail} |" for c in report.criteria]
    lines += ["", "| kind | sent | answered 200 | 5xx | hung | transport errors | statuses |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind, tally in sorted(report.tallies.items()):
        statuses = ", ".join(f"{k}: {v}" for k, v in sorted(tally.by_status.items()))
        lines.append(f"| {kind} | {tally.sent} | {tally.answered} | {tally.server_errors} | {tally.hung} | "
                     f"{tally.transport_errors} | {statuses} |")
    samples = report.samples + ([report.final] if report.final is not None else [])
    names = sorted({name for s in samples for name in s.rss_mb})
    if samples:
        lines += ["", "| minute | " + " | ".join(f"{n} MB" for n in names) + " | KV blocks in use |",
                  "| --- |" + " --- |" * (len(names) + 1)]
        for s in samples:
            cells = [f"{s.rss_mb[n]:.0f}" if n in s.rss_mb else "-" for n in names]
            lines.append(f"| {s.minute:.1f} | " + " | ".join(cells) + f" | {s.kv_blocks_in_use} |")
    examples = [f"- {kind}: {e}" for kind, t in sorted(report.tallies.items()) for e in t.examples]
    if examples:
        lines += ["", "Failures (first few per kind):", *examples]
    return "\n".join(lines) + "\n"
