"""What a trace (``observe.trace``) says about its slowest requests, in words: for each, where its
time to first token went (waiting, preemptions, prefill chunks and the steps they shared) and its
longest decode stall. Pure over the trace's dict; ``python -m vllm_actors.observe.trace_summary
TRACE [--top N]`` prints it for a file (.json or .json.gz).

With targets (``ttft_target_ms`` in the requests' events), the requests that missed them come
first, latest first; without, the slowest to their first token."""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_actors.observe.trace import REQUESTS_PID


@dataclass
class RequestStory:
    request_id: str
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    ttft_target_ms: float | None = None
    ttft_met: bool | None = None
    e2e_met: bool | None = None
    queued_ms: float = 0.0
    preemptions: int = 0
    chunks: list[tuple[float, int, int]] = field(default_factory=list)  # (ms, step, the step's tokens)
    stall: tuple[float, int, int] | None = None  # the longest decode slice: (ms, step, step tokens)
    runs: list[tuple[float, int]] = field(default_factory=list)  # detail="runs" traces: (ms, steps) per run

    @property
    def late_ms(self) -> float:
        if self.ttft_ms is None:
            return float("inf")
        return self.ttft_ms - (self.ttft_target_ms or 0.0)

    def words(self) -> str:
        parts = [f"waited {self.queued_ms:.1f} ms"]
        if self.preemptions:
            parts.append(f"preempted {self.preemptions}x")
        if self.chunks:
            widest = max(self.chunks, key=lambda chunk: chunk[2])
            parts.append(f"prefill in {len(self.chunks)} chunk(s), {sum(c[0] for c in self.chunks):.1f} ms, sharing "
                         f"steps of up to {widest[2]} tokens (step {widest[1]})")
        if self.stall is not None:
            parts.append(f"longest decode step {self.stall[0]:.1f} ms (step {self.stall[1]}, {self.stall[2]} tokens)")
        if self.runs:  # a trace merged into runs of steps has no single steps to name
            steps = sum(run[1] for run in self.runs)
            slowest = max(ms / max(1, count) for ms, count in self.runs)
            parts.append(f"decoded in {len(self.runs)} run(s) of {steps} steps in all, the slowest "
                         f"{slowest:.1f} ms per step")
        return "; ".join(parts)


def stories(trace: dict[str, Any]) -> list[RequestStory]:
    """One story per request thread of the trace."""
    by_tid: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("pid") == REQUESTS_PID and event["ph"] in ("X", "i"):
            by_tid[event["tid"]].append(event)
    found: list[RequestStory] = []
    for events in by_tid.values():
        request = next((e for e in events if e["ph"] == "X" and e["name"] == "request"), None)
        if request is None:
            continue
        args = request["args"]
        story = RequestStory(str(args.get("id")), args.get("ttft_ms"), args.get("e2e_ms"),
                             ttft_met=args.get("ttft_met"), e2e_met=args.get("e2e_met"))
        for event in events:
            name, ms = event["name"], event.get("dur", 0.0) / 1e3
            step = event["args"].get("step_id", -1)
            tokens = event["args"].get("step_tokens") or 0
            if name.startswith("queued"):
                story.queued_ms += ms
            elif name == "preempted":
                story.preemptions += 1
            elif name == "prefill":
                story.chunks.append((ms, step, tokens))
            elif name == "decode" and "first_step" in event["args"]:
                story.runs.append((ms, int(event["args"].get("steps", 1))))
            elif name == "decode" and (story.stall is None or ms > story.stall[0]):
                story.stall = (ms, step, tokens)
            elif name == "ttft deadline":
                story.ttft_target_ms = event["args"].get("target_ms")
        found.append(story)
    return found


def summary_text(trace: dict[str, Any], top: int = 10) -> str:
    every = stories(trace)
    judged = [story for story in every if story.ttft_met is not None]
    lines = [f"{len(every)} requests in the trace"
             + (f" ({trace['otherData'].get('requests', len(every))} in the log)" if "otherData" in trace else "")]
    if judged:
        missed = sorted((s for s in judged if not s.ttft_met), key=lambda s: s.late_ms, reverse=True)
        late_e2e = sum(1 for s in every if s.e2e_met is False)
        lines.append(f"TTFT target met by {len(judged) - len(missed)} of {len(judged)} with one; end-to-end target "
                     f"missed by {late_e2e}")
        shown, title = missed[:top], "missed their TTFT target, latest first"
    else:
        shown = sorted(every, key=lambda s: -(s.ttft_ms or 0.0))[:top]
        title = "slowest to their first token"
    lines.append(f"{len(shown)} {title}:")
    for story in shown:
        target = f" (target {story.ttft_target_ms:g} ms)" if story.ttft_target_ms is not None else ""
        ttft = f"{story.ttft_ms:.1f} ms" if story.ttft_ms is not None else "none"
        lines.append(f"- {story.request_id}: TTFT {ttft}{target}: {story.words()}")
    return "\n".join(lines)


def load(path: str | Path) -> dict[str, Any]:
    data = Path(path).read_bytes()
    return dict(json.loads(gzip.decompress(data) if str(path).endswith(".gz") else data))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_actors.observe.trace_summary", description=__doc__)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args(argv)
    for path in args.traces:
        sys.stdout.write(f"## {path}\n{summary_text(load(path), args.top)}\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
