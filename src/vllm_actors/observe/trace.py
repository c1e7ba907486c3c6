"""The metrics store's event log as a Chrome trace (the Trace Event Format that ui.perfetto.dev
and chrome://tracing open): events in, one JSON-ready dict out. Pure: no files, sockets or clocks
(``trace_file`` is its shell).

Time is each batch's wall clock (the one clock every actor shares), in microseconds from the
first event. Two processes:

* ``actors`` (pid 1): a thread per actor. A worker's steps are slices ``step N`` ending at the
  worker's stamp and lasting ``execute_ms`` (cut where they overlap the previous step: a deferred
  step is launched before the one before it is read back), with the batch in their args; every
  other event without a request id is an instant on its actor's thread. Counters: ``kv cache``
  (blocks in use, cached idle, free, from KV_POOL), ``kv usage %``, ``requests`` (running and
  waiting, from the lifecycle events), ``batch`` (sequences and tokens per step) and ``host kv``
  (the host tier's slots, from BLOCK_OFFLOADED / BLOCK_RESTORED, each also an instant). Under
  pipeline parallelism each stage's first worker has its thread: its bubbles are the gaps between
  its steps, and ``otherData.pipeline_bubbles`` holds each stage's bubble fraction (as ``stats``).
* ``requests`` (pid 2): a thread per request, by first appearance: a ``request`` slice from
  arrival to its end holding ``queued`` (QUEUED or PREEMPTED to SCHEDULED or RESUMED),
  ``prefill`` chunks and ``decode`` slices placed on the worker's step they ran in (args: step id,
  the step's sequences and tokens; a flow arrow from each prefill chunk to its step), and instants
  for arrival, first token, preemption, finish or abort and the KV events of the request. A
  request whose events carry ``ttft_target_ms`` / ``e2e_target_ms`` gets ``ttft deadline`` /
  ``e2e deadline`` instants where they fell due (from its arrival) and, in its ``request`` slice,
  its TTFT and end-to-end milliseconds and whether it met each.

Every trace event made from log events names them in ``args.ev`` (``"actor:seq"``; counters
outside their args), so a trace can be checked against the log it came from: in full detail,
every log event is named. ``TraceOptions`` trade detail for size: ``detail="runs"``
merges a request's consecutive decode steps into one slice; ``request_stride=k`` keeps every k-th
request's thread (the actor threads and counters always see every event).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm_actors.actors.metrics_store.bubbles import PipelineBubbles
from vllm_actors.observe.trace_parts import (
    RequestTrack,
    Slice,
    Step,
    around_steps,
    event_args,
    middle,
    sequential,
    source_key,
)
from vllm_actors.protocol.events import Event, StepFinished, event_type

TraceRow = tuple[str, int, float, float, Event]  # (actor, seq, mono, wall, event), as the store logs them
ACTORS_PID, REQUESTS_PID = 1, 2
# Thread ids are unique across both processes: Perfetto keys threads (and their names) by tid alone.
# Process metadata goes on tid = pid (1, 2), actors from ACTOR_TID_BASE on.
ACTOR_TID_BASE, REQUEST_TID_BASE = 10, 1_000_000
# Targets a request may carry (in milliseconds from its arrival), and the instants that mark them.
DEADLINES = {"ttft_target_ms": "ttft deadline", "e2e_target_ms": "e2e deadline"}


@dataclass(frozen=True)
class TraceOptions:
    detail: str = "steps"  # "steps": a decode slice per step; "runs": a request's decode steps merged
    request_stride: int = 1  # keep every k-th request's thread (by first appearance)


class _Builder:
    def __init__(self, options: TraceOptions) -> None:
        if options.detail not in ("steps", "runs") or options.request_stride < 1:
            raise ValueError(f"bad trace options: {options}")
        self.options = options
        self.t0 = 0.0
        self.out: list[dict[str, Any]] = []
        self.actor_tids: dict[str, int] = {}
        # (replica, step id) -> the first worker's step (requests are placed on it); step ids are a
        # replica's own (data parallelism: "scheduler@1" plans the steps of "worker-0@1")
        self.steps: dict[tuple[str, int], Step] = {}
        self.replica = ""  # of the actor whose event is being added
        self.worker_steps: dict[tuple[str, int], Step] = {}  # (worker, step id) -> its step
        self.step_tracks: dict[str, list[Step]] = {}
        self.requests: dict[str, RequestTrack] = {}
        self.state: dict[str, str] = {}  # request id -> "running" / "waiting"
        self.flows = 0

    # ------------------------------------------------------------------ helpers
    def us(self, wall: float) -> float:
        return round((wall - self.t0) * 1e6, 1)

    def actor_tid(self, actor: str) -> int:
        return self.actor_tids.setdefault(actor, ACTOR_TID_BASE + len(self.actor_tids) + 1)

    def request(self, request_id: str) -> RequestTrack:
        found = self.requests.get(request_id)
        if found is None:
            index = len(self.requests)
            found = self.requests[request_id] = RequestTrack(tid=REQUEST_TID_BASE + index + 1,
                                                         shown=index % self.options.request_stride == 0)
        return found

    def instant(self, pid: int, tid: int, ts: float, name: str, args: dict[str, Any]) -> None:
        self.out.append({"ph": "i", "s": "t", "name": name, "pid": pid, "tid": tid, "ts": ts, "args": args})

    def counter(self, tid: int, ts: float, name: str, args: dict[str, Any], key: str | None = None) -> None:
        counter = {"ph": "C", "name": name, "pid": ACTORS_PID, "tid": tid, "ts": ts, "args": args}
        if key is not None:  # outside args: every arg of a counter is a series
            counter["ev"] = key
        self.out.append(counter)

    def count_requests(self, tid: int, ts: float) -> None:
        running = sum(1 for state in self.state.values() if state == "running")
        self.counter(tid, ts, "requests", {"running": running, "waiting": len(self.state) - running})

    # ------------------------------------------------------------------ the two passes
    def build(self, rows: list[TraceRow]) -> dict[str, Any]:
        # From the earliest instant shown: a step's slice starts its execute time before its
        # STEP_FINISHED, which can be before the first event logged (a step launched while the
        # scheduler's events of the same turn were still unpublished).
        self.t0 = min((row[3] - step_seconds(row[4]) for row in rows), default=0.0)
        bubbles = PipelineBubbles()  # a pipeline's stages: each one's track, its bubbles the gaps
        for actor, seq, _, wall, event in rows:  # the workers' steps first: request slices are placed on them
            kind = event_type(event)
            if kind in ("STEP_STARTED", "STEP_FINISHED"):
                self.add_step(actor, seq, self.us(wall), event)
            if isinstance(event, StepFinished):
                bubbles.step(actor, wall, event)
        for actor, seq, _, wall, event in rows:
            self.add(actor, source_key(actor, seq), self.us(wall), event)
        self.finish_requests()
        self.emit_steps()
        return {
            "traceEvents": self.metadata() + self.out,
            "displayTimeUnit": "ms",
            "otherData": {
                "source": "vllm_actors metrics store event log", "t0_wall": self.t0, "events": len(rows),
                "requests": len(self.requests),
                "requests_shown": sum(1 for request in self.requests.values() if request.shown),
                "detail": self.options.detail, "request_stride": self.options.request_stride,
                **({"pipeline_bubbles": fractions} if (fractions := bubbles.fractions()) else {}),
            },
        }

    def add_step(self, actor: str, seq: int, ts: float, event: Any) -> None:
        step = self.worker_steps.get((actor, event.step_id))
        if step is None:  # with tensor parallelism every worker reports the step: a slice on each
            step = self.worker_steps[(actor, event.step_id)] = Step(start=ts, end=ts, args={}, keys=[])
            self.steps.setdefault((replica_key(actor), event.step_id), step)
            self.step_tracks.setdefault(actor, []).append(step)
        step.keys.append(source_key(actor, seq))
        step.args.update(event_args(event))
        if event_type(event) == "STEP_FINISHED":
            step.end = ts
            step.start = max(ts - step_seconds(event) * 1e6, 0.0)  # t0 is at most this: 0 less rounding

    def add(self, actor: str, key: str, ts: float, event: Event) -> None:
        kind = event_type(event)
        self.replica = replica_key(actor)
        tid = self.actor_tid(actor)
        if kind in ("STEP_STARTED", "STEP_FINISHED"):
            if kind == "STEP_FINISHED":
                self.counter(tid, ts, "batch", {"seqs": event.num_seqs, "tokens": event.num_tokens})  # type: ignore[union-attr]
            return  # a step slice (emit_steps)
        if kind == "KV_POOL":
            pool: Any = event
            self.counter(tid, ts, "kv cache", {"in_use": pool.num_in_use, "cached_idle": pool.num_cached_idle,
                                               "free": pool.num_free}, key)
            usage = 100.0 * pool.num_in_use / pool.num_blocks if pool.num_blocks else 0.0
            self.counter(tid, ts, "kv usage %", {"usage": round(usage, 2)}, key)
            return
        if kind in ("BLOCK_OFFLOADED", "BLOCK_RESTORED"):  # the host tier's fill, beside the move's instant
            moved: Any = event
            self.counter(tid, ts, "host kv", {"cached": moved.num_host_cached,
                                              "free": moved.num_host_blocks - moved.num_host_cached}, key)
        if kind == "TOKENS" and event.request_ids:  # type: ignore[union-attr]
            tokens: Any = event
            for request_id, count in zip(tokens.request_ids, tokens.num_output_tokens):
                self.on_token(request_id, key, ts, tokens.step_id, count)
            return
        request_id = getattr(event, "request_id", None)
        if not isinstance(request_id, str):
            self.instant(ACTORS_PID, tid, ts, kind, {**event_args(event), "ev": key})
            return
        self.track_state(request_id, kind, tid, ts)
        self.on_request_event(self.request(request_id), kind, key, ts, event)

    def track_state(self, request_id: str, kind: str, tid: int, ts: float) -> None:
        new = {"QUEUED": "waiting", "PREEMPTED": "waiting", "SCHEDULED": "running", "RESUMED": "running"}.get(kind)
        if new is not None:
            self.state[request_id] = new
        elif kind in ("FINISHED", "ABORTED") and request_id in self.state:
            del self.state[request_id]
        else:
            return
        self.count_requests(tid, ts)

    # ------------------------------------------------------------------ one request
    def close_queue(self, request: RequestTrack, ts: float, key: str, args: dict[str, Any]) -> bool:
        if request.queued is None:
            return False
        since, name, queued_key = request.queued
        request.slices.append(Slice(since, ts, name, {**args, "ev": [queued_key, key]}))
        request.queued = None
        return True

    def on_request_event(self, request: RequestTrack, kind: str, key: str, ts: float, event: Event) -> None:
        if not request.shown:
            return
        args = event_args(event)
        for name in DEADLINES:
            if isinstance(args.get(name), (int, float)) and not isinstance(args.get(name), bool):
                request.targets[name] = float(args[name])
        if kind == "ARRIVED":
            request.arrived = ts
        elif kind == "FIRST_TOKEN" and request.first_token is None:
            request.first_token = ts
        elif kind == "FINISHED":
            request.ended = ts
        request.start = ts if request.start is None else min(request.start, ts)
        request.end = ts if request.end is None else max(request.end, ts)
        if kind in ("QUEUED", "PREEMPTED"):
            self.close_queue(request, ts, key, {})
            request.queued = (ts, "queued" if kind == "QUEUED" else "queued (preempted)", key)
            request.run = None
            if kind == "QUEUED":
                return
        elif kind in ("SCHEDULED", "RESUMED") and self.close_queue(request, ts, key, {kind.lower(): args}):
            return
        elif kind == "PREFILL_CHUNK":
            chunk: Any = event
            step = self.steps.get((self.replica, chunk.step_id))
            start, end = (step.start, step.end) if step is not None else (ts, ts)
            piece = Slice(start, end, "prefill", {**args, **self.step_fields(step), "ev": [key]})
            if step is not None:
                self.flows += 1
                piece.flow = self.flows
                step.flows.append(self.flows)
            request.slices.append(piece)
            request.chunks[chunk.step_id] = piece
            return
        elif kind in ("FINISHED", "ABORTED"):
            self.close_queue(request, ts, key, {})
            request.end_args = {"reason": args.get("reason")}
            request.run = None
        name = {"ARRIVED": "arrived", "FIRST_TOKEN": "first token", "PREEMPTED": "preempted",
                "FINISHED": "finished", "ABORTED": "aborted", "SCHEDULED": "scheduled",
                "RESUMED": "resumed"}.get(kind, kind.lower())
        self.instant(REQUESTS_PID, request.tid, ts, name, {**args, "ev": key})

    def step_fields(self, step: Step | None) -> dict[str, Any]:
        if step is None:
            return {}
        return {"step_seqs": step.args.get("num_seqs"), "step_tokens": step.args.get("num_tokens")}

    def on_token(self, request_id: str, key: str, ts: float, step_id: int, count: int) -> None:
        request = self.request(request_id)
        if not request.shown:
            return
        request.end = ts if request.end is None else max(request.end, ts)
        chunk = request.chunks.pop(step_id, None)
        if chunk is not None:  # the last prefill chunk samples the first token
            chunk.args.update(sampled=True, output_tokens=count)
            chunk.args["ev"].append(key)
            return
        step = self.steps.get((self.replica, step_id))
        start, end = (step.start, step.end) if step is not None else (ts, ts)
        if self.options.detail == "runs" and request.run is not None:
            run = request.run
            run.end = max(run.end, end)
            run.args.update(last_step=step_id, output_tokens=count, steps=run.args["steps"] + 1)
            run.args["ev"][1:] = [key]
            return
        args = {"step_id": step_id, "output_tokens": count, **self.step_fields(step), "ev": [key]}
        if self.options.detail == "runs":
            args = {"first_step": step_id, "last_step": step_id, "steps": 1, "output_tokens": count, "ev": [key]}
        piece = Slice(start, end, "decode", args)
        request.slices.append(piece)
        if self.options.detail == "runs":
            request.run = piece

    # ------------------------------------------------------------------ output
    def finish_requests(self) -> None:
        for request_id, request in self.requests.items():
            if not request.shown:
                continue
            if request.queued is not None and request.end is not None:  # still waiting when the log ends
                since, name, key = request.queued
                request.slices.append(Slice(since, request.end, name, {"open": True, "ev": [key]}))
            slices = around_steps(request.slices)
            if request.start is None or request.end is None:
                start = min((piece.ts for piece in slices), default=0.0)
                end = max((piece.end for piece in slices), default=start)
            else:
                start = min([request.start, *(piece.ts for piece in slices)])
                end = max([request.end, *(piece.end for piece in slices)])
            self.slice(REQUESTS_PID, request.tid, Slice(start, end, "request", {"id": request_id,
                                                                                 **request.end_args,
                                                                                 **self.deadlines(request, start)}))
            for piece in slices:
                self.slice(REQUESTS_PID, request.tid, piece)
                if piece.flow is not None:
                    self.out.append({"ph": "s", "id": piece.flow, "name": "step", "cat": "step",
                                     "pid": REQUESTS_PID, "tid": request.tid, "ts": middle(piece)})

    def deadlines(self, request: RequestTrack, start: float) -> dict[str, Any]:
        """Instants where the request's targets fell due (from its arrival), whether it met them,
        and its TTFT and end-to-end times in the request slice's args."""
        arrived = request.arrived if request.arrived is not None else start
        reached = {"ttft_target_ms": request.first_token, "e2e_target_ms": request.ended}
        figures: dict[str, Any] = {}
        for name, at in reached.items():
            if at is not None:
                figures[name.replace("_target", "")] = round((at - arrived) / 1e3, 3)
            target = request.targets.get(name)
            if target is not None:
                due = arrived + target * 1e3
                met = at is not None and at <= due
                figures[name.replace("_target_ms", "_met")] = met
                self.instant(REQUESTS_PID, request.tid, round(due, 1), DEADLINES[name],
                             {"target_ms": target, "met": met})
        return figures

    def emit_steps(self) -> None:
        for actor, track in self.step_tracks.items():
            tid = self.actor_tid(actor)
            ordered = sequential([Slice(step.start, step.end, f"step {step.args.get('step_id')}",
                                          {**step.args, "ev": step.keys}, flows_in=step.flows) for step in track])
            for piece in ordered:
                self.slice(ACTORS_PID, tid, piece)
                for flow in piece.flows_in:
                    self.out.append({"ph": "f", "bp": "e", "id": flow, "name": "step", "cat": "step",
                                     "pid": ACTORS_PID, "tid": tid, "ts": middle(piece)})

    def slice(self, pid: int, tid: int, piece: Slice) -> None:
        start, end = round(piece.ts, 1), round(piece.end, 1)  # each end rounded alike: no overlap made
        self.out.append({"ph": "X", "name": piece.name, "pid": pid, "tid": tid, "ts": start,
                         "dur": round(max(end - start, 0.0), 1), "args": piece.args})

    def metadata(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for pid, name in ((ACTORS_PID, "actors"), (REQUESTS_PID, "requests")):
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": pid, "ts": 0,
                           "args": {"name": name}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": pid, "ts": 0,
                           "args": {"sort_index": pid}})
        names = [(ACTORS_PID, tid, actor) for actor, tid in self.actor_tids.items()]
        names += [(REQUESTS_PID, r.tid, request_id) for request_id, r in self.requests.items() if r.shown]
        for pid, tid, name in names:
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "ts": 0, "args": {"name": name}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "ts": 0,
                           "args": {"sort_index": tid}})
        return events


def step_seconds(event: Any) -> float:
    """How long before its own time a STEP_FINISHED's slice starts (0 for any other event)."""
    return max(float(event.execute_ms), 0.0) / 1e3 if event_type(event) == "STEP_FINISHED" else 0.0


def replica_key(actor: str) -> str:
    """The replica an actor id names after "@" ("scheduler@1": "1"); "" for a bare name."""
    name, separator, replica = actor.rpartition("@")
    return replica if separator and name and replica.isdigit() else ""


def chrome_trace(rows: Iterable[TraceRow], options: TraceOptions | None = None) -> dict[str, Any]:
    """The Chrome trace of ``rows`` (in the order the store applied them)."""
    return _Builder(options or TraceOptions()).build(list(rows))
