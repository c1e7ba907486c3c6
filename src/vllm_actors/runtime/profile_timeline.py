"""The GPU timeline of a step profile: where the device was busy, for how long, and how long it
waited between bursts of work.

A torch profile's kernel table (``-top.txt``) sums each kernel's time but hides two things that
decide a decode step's speed: the gaps between kernels inside a CUDA graph (launch latency, about a
microsecond per kernel) and the idle time between steps (the host not feeding the GPU). This groups
the trace's device events (kernels, copies, memsets) into bursts separated by more than
``gap_us`` of idle time (one burst per step when the host is the limit, one long burst when steps
run back to back) and reports, per burst, its span, the kernels' summed time and its count, and
the idle time before it. Found by hand twice before it was written: the GPU idling 0.5 ms between
batch-1 steps (a scheduler that kept one step in flight), then steps back to back after the fix.

``marginal_times`` answers the next question, which kernel the step's time goes to, also where
kernels overlap (programmatic dependent launch starts a kernel, and its clock, while the one
before still runs, so a kernel's own duration then includes its wait): taken in the order they
end, each device event is charged the time by which it moves the end of the work so far, and idle
gaps over ``gap_us`` are charged to no one. The charges add up to the bursts' spans.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True)
class Burst:
    start_us: float  # from the first device event of the trace
    span_us: float  # first event's start to the last one's end
    busy_us: float  # the events' summed durations (overlaps counted twice)
    num_events: int
    idle_before_us: float  # since the previous burst's end (0 for the first)


def device_bursts(events: Iterable[Mapping[str, Any]], gap_us: float = 200.0) -> list[Burst]:
    """Bursts of device work in a Chrome trace's events (``ph == "X"`` of the device categories)."""
    device = sorted(
        ((float(e["ts"]), float(e.get("dur", 0.0))) for e in events
         if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
    )
    if not device:
        return []
    origin = device[0][0]
    bursts: list[Burst] = []
    start, end, busy, count, idle = device[0][0], device[0][0] + device[0][1], device[0][1], 1, 0.0
    for ts, dur in device[1:]:
        if ts - end > gap_us:
            bursts.append(Burst(start - origin, end - start, busy, count, idle))
            idle = ts - end
            start, end, busy, count = ts, ts + dur, dur, 1
        else:
            end, busy, count = max(end, ts + dur), busy + dur, count + 1
    bursts.append(Burst(start - origin, end - start, busy, count, idle))
    return bursts


def format_bursts(bursts: list[Burst], gap_us: float = 200.0) -> str:
    """A table of the bursts and a line of totals (device busy share of the window)."""
    if not bursts:
        return "device timeline: no device events (CPU profile)\n"
    lines = [f"device timeline (bursts of work split at idle gaps over {gap_us:.0f} us):",
             f"{'start ms':>10} {'span ms':>9} {'kernels ms':>11} {'events':>7} {'idle before ms':>15}"]
    for burst in bursts:
        lines.append(f"{burst.start_us / 1e3:10.3f} {burst.span_us / 1e3:9.3f} {burst.busy_us / 1e3:11.3f} "
                     f"{burst.num_events:7d} {burst.idle_before_us / 1e3:15.3f}")
    window = bursts[-1].start_us + bursts[-1].span_us
    idle = sum(burst.idle_before_us for burst in bursts)
    spans = sum(burst.span_us for burst in bursts)
    busy = sum(burst.busy_us for burst in bursts)
    share = 100 * idle / window if window else 0.0
    inside = max(spans - busy, 0.0)  # launch gaps between a burst's kernels (overlaps count against it)
    lines.append(f"window {window / 1e3:.3f} ms: idle between bursts {idle / 1e3:.3f} ms ({share:.1f}%), "
                 f"gaps inside bursts {inside / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Marginal:
    name: str
    count: int
    total_us: float  # the time by which this name's events moved the end of the device's work


def marginal_times(events: Iterable[Mapping[str, Any]], gap_us: float = 200.0) -> list[Marginal]:
    """Each device event's marginal time (its end minus the latest end before it, an idle gap over
    ``gap_us`` not counted), summed per name, largest first."""
    device = sorted(
        ((float(e["ts"]) + float(e.get("dur", 0.0)), float(e["ts"]), str(e.get("name", "?"))) for e in events
         if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
    )
    totals: dict[str, list[float]] = {}
    latest: float | None = None
    for end, start, name in device:
        if latest is None or start - latest > gap_us:  # a burst's first event: charged its own duration
            charge = end - start
        else:
            charge = max(end - latest, 0.0)
        latest = end if latest is None else max(latest, end)
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += charge
    return sorted((Marginal(name, int(count), total) for name, (count, total) in totals.items()),
                  key=lambda m: -m.total_us)


def format_marginals(marginals: list[Marginal], limit: int = 25) -> str:
    if not marginals:
        return ""
    total = sum(m.total_us for m in marginals) or 1.0
    lines = ["marginal time by kernel (what each moved the end of the device's work, overlaps resolved):",
             f"{'ms':>9} {'share':>6} {'count':>6} {'us each':>8}  name"]
    for m in marginals[:limit]:
        lines.append(f"{m.total_us / 1e3:9.3f} {100 * m.total_us / total:5.1f}% {m.count:6d} "
                     f"{m.total_us / m.count:8.2f}  {m.name[:90]}")
    return "\n".join(lines) + "\n"
