"""Replay a Chrome trace's steps through the step cost model as the scheduler sees them (issue 35), and
print how far its predictions were from the steps' wall time, the chunks' scan of their context priced
with their pairs (before) and as a feature of its own (after).

    python benchmarks/cost_replay.py TRACE.json.gz [--lag 2]

The trace (``observe/trace.py``): worker step slices ``step N`` (args ``execute_ms``: launch to read-back;
the slice is cut where it overlaps the previous step: its wall share), each request's ``prefill`` slices
(args ``step_id``, ``start``, ``num_tokens``) and ``STEP_TIMED`` instants (``gpu_ms`` of a step that
sampled nothing). Each step's features are its prefill chunks' tokens and attention (``chunk_pairs`` and
``chunk_scan``: summed into one feature before, two after) and its other sequences as decodes. Step k is
predicted by the model after the results up to k - lag (two steps in flight: the plan of k is made once
k - 2 is back). Taught as ``LateTimings`` teaches it: the slice (``interval_seconds``), a timed step's GPU
time, nothing from the step right after a timed one (its interval holds the timed step's GPU time).

A pair of steps read back together (the second's wall share under ``BUNCHED_FRACTION`` of its execute
time) is taught, and judged, at its average wall share. Errors are predicted / wall - 1 over the steps
holding the long prompt's chunk beside decodes, per 100k of its context: mean, and the 50th and 90th
percentiles of their size. Then the tail (``tail_report``): the mixed steps' wall over predicted, and which of
them were serial (launched after the step before was read back: the host's launch on the decodes' path)."""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from vllm_actors.actors.scheduler.cost_model import OnlineCostModel, chunk_pairs, chunk_scan
from vllm_actors.actors.scheduler.late_timings import BUNCHED_FRACTION


@dataclass
class Step:
    prefill_tokens: int
    decodes: int
    chunks: list[tuple[int, int]]
    execute: float
    wall: float
    gpu: float | None
    context: int = -1  # the longest-context chunk's start (-1: none)
    features: dict[str, float] = field(default_factory=dict)


def load(path: str) -> list[Step]:
    with gzip.open(path) as stream:
        events = json.load(stream)["traceEvents"]
    slices = {e["args"]["step_id"]: e for e in events
              if e.get("ph") == "X" and e.get("pid") == 1 and e.get("name", "").startswith("step ")}
    chunks: defaultdict[int, list[tuple[int, int]]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("name") == "prefill" and e["args"]["num_tokens"] > 1:
            chunks[e["args"]["step_id"]].append((e["args"]["start"], e["args"]["num_tokens"]))
    gpu = {e["args"]["step_id"]: e["args"]["gpu_ms"] / 1e3 for e in events if e.get("name") == "STEP_TIMED"}
    steps = []
    for step_id in sorted(slices):
        args, own = slices[step_id]["args"], chunks.get(step_id, [])
        steps.append(Step(prefill_tokens=sum(n for _, n in own), decodes=args["num_seqs"] - len(own), chunks=own,
                          execute=args["execute_ms"] / 1e3, wall=slices[step_id]["dur"] / 1e6,
                          gpu=gpu.get(step_id), context=max((start for start, _ in own), default=-1)))
    return steps


def bunched(steps: list[Step], k: int) -> bool:
    """Step k was read back right after step k - 1 (``late_timings.BUNCHED_FRACTION``): their wall shares
    are one step's worth each only on average."""
    return k > 0 and steps[k].gpu is None and steps[k].wall < BUNCHED_FRACTION * steps[k].execute


def paired_walls(steps: list[Step]) -> list[float]:
    """Each step's wall share, a bunched pair's averaged (what each of them cost, as far as the trace says)."""
    walls = [step.wall for step in steps]
    for k in range(1, len(steps)):
        if bunched(steps, k):
            walls[k - 1] = walls[k] = (steps[k - 1].wall + steps[k].wall) / 2
    return walls


def replay(steps: list[Step], separate_scan: bool, lag: int) -> list[float]:
    """Each step's prediction, made before the model saw it (a bunched pair taught as its average)."""
    model = OnlineCostModel()
    pairs = [sum(chunk_pairs(start, n) for start, n in step.chunks) for step in steps]
    scans = [sum(chunk_scan(start, n) for start, n in step.chunks) for step in steps]
    if not separate_scan:
        pairs, scans = [p + s for p, s in zip(pairs, scans, strict=True)], [0.0] * len(steps)
    walls = paired_walls(steps)
    predictions = []
    for k, step in enumerate(steps):
        j = k - lag
        if j >= 0:
            seen, timed_before = steps[j], j > 0 and steps[j - 1].gpu is not None
            if seen.gpu is not None:
                model.observe(seen.prefill_tokens, seen.decodes, seen.gpu, pairs[j], scans[j])
            elif not timed_before:
                model.observe(seen.prefill_tokens, seen.decodes, walls[j], pairs[j], scans[j])
        predictions.append(model.step_seconds(step.prefill_tokens, step.decodes, pairs[k], scans[k]))
    return predictions


def report(steps: list[Step], predictions: list[float], label: str) -> None:
    print(label)
    walls = paired_walls(steps)
    for low in range(0, 1_000_000, 100_000):
        errors = [predictions[k] / walls[k] - 1 for k, step in enumerate(steps)
                  if low <= step.context < low + 100_000 and step.decodes and step.gpu is None and walls[k] > 0]
        if not errors:
            continue
        sizes = sorted(map(abs, errors))
        print(f"  {low // 1000:>4}k  steps {len(errors):4d}  mean {statistics.mean(errors) * 100:+5.0f}%"
              f"  |error| p50 {sizes[len(sizes) // 2] * 100:3.0f}%  p90 {sizes[int(len(sizes) * 0.9)] * 100:3.0f}%")


SERIAL_FRACTION = 0.95  # a wall share at least this part of launch-to-read-back: launched after the step before


def is_serial(step: Step) -> bool:
    """Launched only after the step before was read back (its wall share is its whole launch-to-read-back
    time): the host's launch of it was on its decodes' path, not hidden behind the GPU's step before."""
    return step.execute > 0 and step.wall >= SERIAL_FRACTION * step.execute


def tail_report(steps: list[Step], predictions: list[float]) -> None:
    """The mixed steps (a chunk beside decodes, not timed late): wall over predicted quantiles, and their
    wall time serial against overlapped; the top 2% by wall, how many of them serial."""
    walls = paired_walls(steps)
    mixed = [k for k, step in enumerate(steps)
             if step.decodes and step.chunks and step.gpu is None and walls[k] > 0 and predictions[k] > 0]
    if not mixed:
        print("tail: no mixed steps")
        return
    ratios = sorted(walls[k] / predictions[k] for k in mixed)

    def at(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))]

    print(f"tail: mixed steps {len(mixed)}, wall / predicted p50 {at(ratios, 0.5):.2f} p90 {at(ratios, 0.9):.2f}"
          f" p99 {at(ratios, 0.99):.2f}")
    for label, group in (("serial", [k for k in mixed if is_serial(steps[k])]),
                         ("overlapped", [k for k in mixed if not is_serial(steps[k])])):
        if group:
            values = sorted(steps[k].wall * 1e3 for k in group)
            print(f"  {label:10s} {len(group):5d} steps, wall p50 {at(values, 0.5):.0f} p90 {at(values, 0.9):.0f}"
                  f" p99 {at(values, 0.99):.0f} ms")
    top = sorted(mixed, key=lambda k: steps[k].wall)[int(0.98 * len(mixed)):]
    print(f"  top 2% by wall: {len(top)} steps, {sum(is_serial(steps[k]) for k in top)} serial")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--lag", type=int, default=2, help="steps in flight: step k predicted after k - lag")
    args = parser.parse_args()
    steps = load(args.trace)
    report(steps, replay(steps, separate_scan=False, lag=args.lag), "before: the scan priced with the pairs")
    after = replay(steps, separate_scan=True, lag=args.lag)
    report(steps, after, "after: the scan a feature of its own")
    tail_report(steps, after)


if __name__ == "__main__":
    main()
