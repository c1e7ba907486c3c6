"""The metrics store's event log as a Chrome trace (observe/trace.py, observe/trace_file.py,
``vllm-actors stats --trace``): valid Trace Event Format, every log event mapped, requests placed
on the worker steps they ran in."""

from __future__ import annotations

import gzip
import json
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from tests.support.lifecycle import settled_metrics
from tests.support.trace_check import check_covers, check_schema
from vllm_actors import LLM, SamplingParams
from vllm_actors.observe.trace import ACTORS_PID, REQUESTS_PID, TraceOptions, chrome_trace
from vllm_actors.observe.trace_file import fitted_trace, read_dump, trace_from_store, write_trace
from vllm_actors.protocol.events import (
    Allocated,
    Arrived,
    BlockOffloaded,
    BlockRestored,
    Finished,
    FirstToken,
    Freed,
    Heartbeat,
    KvPool,
    Preempted,
    PrefillChunk,
    Queued,
    Resumed,
    Scheduled,
    StepFinished,
    StepStarted,
    Tokens,
)
from vllm_actors.protocol.metrics import DumpQuery, DumpReply


def _story() -> list[tuple[str, int, float, float, object]]:
    """Request "a": queued, two prefill chunks (steps 0, 1), a decode step (2), preempted,
    resumed, recomputed (3), decode (4), finished. Walls in seconds from 100."""
    rows: list[tuple[str, int, float, float, object]] = []
    seqs: dict[str, int] = {}

    def at(actor: str, wall: float, *events: object) -> None:
        for event in events:
            seq = seqs.get(actor, 0)
            seqs[actor] = seq + 1
            rows.append((actor, seq, wall, 100.0 + wall, event))

    def step(step_id: int, end: float, seqs_: int, tokens: int) -> None:
        at("worker-0", end, StepStarted(step_id=step_id, num_seqs=seqs_, num_tokens=tokens, num_prefill_seqs=1),
           StepFinished(step_id=step_id, num_seqs=seqs_, num_tokens=tokens, num_sampled=1, execute_ms=10.0))

    at("client-1", 0.0, Arrived(request_id="a", num_prompt_tokens=40, max_tokens=3))
    at("worker-0", 0.0, Heartbeat(pid=7))
    at("scheduler", 0.001, Queued(request_id="a", num_waiting=1))
    at("scheduler", 0.050, Scheduled(request_id="a", step_id=0), PrefillChunk(request_id="a", step_id=0, start=0,
                                                                               num_tokens=24, last=False))
    at("kv_cache_manager", 0.051, Allocated(request_id="a", block_ids=list(range(12)), num_free_blocks=4),
       KvPool(num_blocks=16, num_free=4, num_cached=0, num_cached_idle=0, num_in_use=12))
    step(0, 0.070, 1, 24)
    at("scheduler", 0.071, PrefillChunk(request_id="a", step_id=1, start=24, num_tokens=16, last=True))
    step(1, 0.090, 1, 16)
    at("scheduler", 0.091, FirstToken(request_id="a", step_id=1), Tokens(step_id=1, request_ids=["a"],
                                                                          num_output_tokens=[1]))
    step(2, 0.110, 1, 1)
    at("scheduler", 0.111, Tokens(step_id=2, request_ids=["a"], num_output_tokens=[2]),
       Preempted(request_id="a", step_id=3, num_computed_tokens=41))
    at("scheduler", 0.200, Resumed(request_id="a", step_id=3), PrefillChunk(request_id="a", step_id=3, start=0,
                                                                             num_tokens=42, last=True))
    step(3, 0.230, 1, 42)
    at("scheduler", 0.231, Tokens(step_id=3, request_ids=["a"], num_output_tokens=[3]),
       Finished(request_id="a", reason="length", num_prompt_tokens=40, num_output_tokens=3))
    at("kv_cache_manager", 0.232, Freed(request_id="a", num_blocks=12, num_free_blocks=16))
    return rows


def _request_slices(events: list[dict]) -> list[tuple[str, float, float, dict]]:
    return [(e["name"], e["ts"], e["ts"] + e["dur"], e["args"]) for e in events
            if e["ph"] == "X" and e["pid"] == REQUESTS_PID]


def test_one_request_story_as_slices_on_its_steps() -> None:
    rows = _story()
    trace = chrome_trace(rows)
    events = check_covers(trace, rows)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["a", "client-1", "kv_cache_manager", "scheduler", "worker-0"]
    slices = _request_slices(events)
    assert [name for name, *_ in slices] == ["request", "queued", "prefill", "prefill", "decode",
                                             "queued (preempted)", "prefill"]
    request, queued, chunk0, chunk1, decode, requeued, recompute = slices
    assert request[1] == 0.0 and request[2] == pytest.approx(232_000)  # us from the first event to FREED
    assert (queued[1], queued[2]) == pytest.approx((1_000, 50_000))
    assert (chunk0[1], chunk0[2]) == pytest.approx((60_000, 70_000))  # step 0: the worker's stamp - 10 ms
    assert chunk0[3]["step_id"] == 0 and chunk0[3]["step_tokens"] == 24 and chunk0[3]["step_seqs"] == 1
    assert chunk1[3]["sampled"] and chunk1[3]["output_tokens"] == 1  # the last chunk drew the first token
    assert (decode[1], decode[2]) == pytest.approx((100_000, 110_000)) and decode[3]["step_id"] == 2
    assert (requeued[1], requeued[2]) == pytest.approx((111_000, 200_000))
    assert (recompute[1], recompute[2]) == pytest.approx((220_000, 230_000)) and recompute[3]["start"] == 0
    instants = [e["name"] for e in events if e["ph"] == "i" and e["pid"] == REQUESTS_PID]
    assert instants == ["arrived", "allocated", "first token", "preempted", "finished", "freed"]
    allocated = next(e for e in events if e["name"] == "allocated")
    assert allocated["args"]["block_ids"] == [0, 1, 2, 3, "+8 more"]
    steps = [e for e in events if e["ph"] == "X" and e["pid"] == ACTORS_PID]
    assert [e["name"] for e in steps] == ["step 0", "step 1", "step 2", "step 3"]
    # a flow from each prefill chunk to its step
    flows = {(e["ph"], e["pid"]) for e in events if e["ph"] in ("s", "f")}
    assert flows == {("s", REQUESTS_PID), ("f", ACTORS_PID)}
    assert sum(1 for e in events if e["ph"] == "s") == 3
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"kv cache", "kv usage %", "requests", "batch"}
    running = [(e["args"]["running"], e["args"]["waiting"]) for e in events if e["name"] == "requests"]
    assert running == [(0, 1), (1, 0), (0, 1), (1, 0), (0, 0)]


def test_runs_and_strides_make_smaller_traces() -> None:
    rows = _story()
    full = chrome_trace(rows)
    merged = chrome_trace(rows, TraceOptions(detail="runs"))
    check_schema(merged)
    decodes = [e for e in merged["traceEvents"] if e["name"] == "decode"]
    assert len(decodes) == 1 and decodes[0]["args"]["steps"] == 1
    assert len(json.dumps(merged)) <= len(json.dumps(full))
    rows_b = [(actor, seq, mono, wall, event) for actor, seq, mono, wall, event in rows]
    rows_b += [("client-1", 100 + i, 0.0, 100.0 + 0.3 + i * 1e-3, Arrived(request_id=f"b{i}", num_prompt_tokens=1,
                                                                          max_tokens=1)) for i in range(4)]
    sparse = chrome_trace(rows_b, TraceOptions(detail="runs", request_stride=2))
    shown = [e["args"]["name"] for e in sparse["traceEvents"] if e["name"] == "thread_name" and
             e["pid"] == REQUESTS_PID]
    assert shown == ["a", "b1", "b3"] and sparse["otherData"]["requests_shown"] == 3
    # the actor threads and counters still see every event
    assert {e["args"]["name"] for e in sparse["traceEvents"] if e["name"] == "thread_name"} >= {"worker-0"}
    encoded, _ = fitted_trace(rows_b, max_bytes=len(json.dumps(merged)) // 2)
    assert json.loads(encoded)["otherData"]["request_stride"] > 1


def _prompts(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, 300) for _ in range(rng.randint(4, 90))]} for _ in range(count)]


def _params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_in_process_run_of_the_tiny_model(tiny_qwen3: Path, tmp_path: Path) -> None:
    with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32", num_gpu_blocks_override=12,
             max_num_batched_tokens=48, block_size=8) as llm:
        outputs = llm.generate(_prompts(8, seed=3), _params(), use_tqdm=False)
        assert all(len(output.outputs[0].token_ids) == 12 for output in outputs)
        reply = llm.engine.query_metrics(DumpQuery())
        assert isinstance(reply, DumpReply)
        rows = read_dump(reply.path)
        assert len(rows) == llm.engine.metrics_store.num_events  # type: ignore[attr-defined]  # the whole run
        from_store = trace_from_store(llm.engine.query_metrics, tmp_path / "store.json", max_bytes=None)
    assert from_store.num_events == len(rows) and from_store.options == TraceOptions()
    written = write_trace(rows, tmp_path / "trace.json.gz", max_bytes=None)
    trace = json.loads(gzip.decompress(Path(written.path).read_bytes()))
    assert trace == json.loads(Path(from_store.path).read_bytes())
    events = check_covers(trace, rows)
    names = [e["name"] for e in events]
    assert {"queued", "prefill", "decode", "first token", "finished", "preempted", "queued (preempted)"} <= set(names)
    requests = {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == REQUESTS_PID}
    assert requests == {output.request_id for output in outputs}
    decodes = [e for e in events if e["name"] == "decode"]
    assert all(e["args"]["step_seqs"] >= 1 for e in decodes)
    # a size bound: less detail, within the bound as written, still valid
    for name in ("capped.json", "capped.json.gz"):
        cap = written.num_bytes * (3 if name == "capped.json" else 1) // 4
        capped = write_trace(rows, tmp_path / name, max_bytes=cap)
        assert capped.num_bytes <= cap and (capped.options != TraceOptions() or capped.num_left_out)
        data = Path(capped.path).read_bytes()
        check_schema(json.loads(gzip.decompress(data) if name.endswith(".gz") else data))


def test_stats_trace_of_a_process_group(tiny_qwen3: Path, tmp_path: Path) -> None:
    with LLM(str(tiny_qwen3), dtype="float32", num_gpu_blocks_override=12, max_num_batched_tokens=48,
             block_size=8) as llm:
        assert llm.group is not None
        outputs = llm.generate(_prompts(6, seed=5), _params(), use_tqdm=False)
        wanted = {output.request_id for output in outputs}
        settled_metrics(llm, lambda m: m.requests_finished >= len(wanted) and m.kv_blocks_in_use == 0)
        trace_path, dump_path = tmp_path / "out.json", tmp_path / "events.jsonl"
        done = subprocess.run([sys.executable, "-m", "vllm_actors", "stats", "--run-dir", str(llm.group.run_dir),
                               "--trace", str(trace_path), "--dump", str(dump_path)],
                              capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"trace: {trace_path}")
    rows = read_dump(dump_path)
    trace = json.loads(trace_path.read_bytes())
    events = check_covers(trace, rows)
    actors = {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == ACTORS_PID}
    assert {"scheduler", "kv_cache_manager", "worker-0", "metrics"} <= actors
    requests = {e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == REQUESTS_PID}
    assert wanted <= requests
    kinds = {e["name"] for e in events}
    assert {"queued", "prefill", "decode", "first token", "finished", "READY", "kv cache", "requests"} <= kinds


def test_the_event_log_bounds_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A benchmark that traces a whole run raises the store's bounds through the environment."""
    from vllm_actors.actors.metrics_store.store import MetricsStore
    from vllm_actors.runtime.metrics_shell import MAX_BYTES_ENV, MAX_EVENTS_ENV, store_bounds

    monkeypatch.delenv(MAX_EVENTS_ENV, raising=False)
    monkeypatch.delenv(MAX_BYTES_ENV, raising=False)
    assert store_bounds(50_000) == {"max_events": 50_000}
    monkeypatch.setenv(MAX_EVENTS_ENV, "200000")
    monkeypatch.setenv(MAX_BYTES_ENV, str(1 << 28))
    bounds = store_bounds(50_000)
    assert bounds == {"max_events": 200_000, "max_history_bytes": 1 << 28}
    assert MetricsStore(**bounds).max_events == 200_000
    monkeypatch.setenv(MAX_EVENTS_ENV, "0")
    with pytest.raises(ValueError, match=MAX_EVENTS_ENV):
        store_bounds(50_000)


def test_every_worker_of_a_step_gets_its_slice() -> None:
    """Tensor parallelism: each worker reports each step; the request sits on the first's."""
    rows = _story()
    twins = [("worker-1", seq, mono, wall + 0.002, event) for actor, seq, mono, wall, event in rows
             if actor == "worker-0" and isinstance(event, (StepStarted, StepFinished))]
    rows += twins
    trace = chrome_trace(rows)
    events = check_covers(trace, rows)
    tids = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name" and e["pid"] == ACTORS_PID}
    steps = [(e["tid"], e["name"]) for e in events if e["ph"] == "X" and e["pid"] == ACTORS_PID]
    assert sorted(steps) == sorted([(tids[w], f"step {i}") for w in ("worker-0", "worker-1") for i in range(4)])
    chunk = next(e for e in events if e["name"] == "prefill")
    assert (chunk["ts"], chunk["ts"] + chunk["dur"]) == pytest.approx((60_000, 70_000))  # worker-0's step 0
    assert {e["tid"] for e in events if e["ph"] == "f"} == {tids["worker-0"]}


class _ArrivedWithTargets(msgspec.Struct, tag="ARRIVED", kw_only=True):
    """ARRIVED as a request with targets may carry them (the policies' fields)."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0
    ttft_target_ms: float | None = None
    e2e_target_ms: float | None = None


def test_deadlines_of_a_request_show_where_they_fell_due() -> None:
    rows = _story()
    actor, seq, mono, wall, _ = rows[0]
    rows[0] = (actor, seq, mono, wall, _ArrivedWithTargets(request_id="a", num_prompt_tokens=40, max_tokens=3,
                                                            priority=2, ttft_target_ms=50.0, e2e_target_ms=300.0))
    events = check_covers(chrome_trace(rows), rows)  # type: ignore[arg-type]
    due = {e["name"]: (e["ts"], e["args"]) for e in events if e["name"].endswith("deadline")}
    assert due == {"ttft deadline": (50_000, {"target_ms": 50.0, "met": False}),  # first token at 91 ms
                   "e2e deadline": (300_000, {"target_ms": 300.0, "met": True})}  # finished at 231 ms
    request = next(e for e in events if e["name"] == "request")
    assert request["args"]["ttft_ms"] == pytest.approx(91.0) and request["args"]["e2e_ms"] == pytest.approx(231.0)
    assert request["args"]["ttft_met"] is False and request["args"]["e2e_met"] is True
    arrived = next(e for e in events if e["name"] == "arrived")
    assert arrived["args"]["priority"] == 2
    plain = [e for e in check_covers(chrome_trace(_story()), _story()) if e["name"] == "request"]
    assert "ttft_met" not in plain[0]["args"] and plain[0]["args"]["ttft_ms"] == pytest.approx(91.0)


def test_a_token_of_the_step_in_flight_at_a_preemption_keeps_its_step() -> None:
    """With two steps in flight, PREEMPTED is stamped while the step before it still runs; that
    step's decode slice stays on the step and the wait starts when it ends."""
    rows = _story()
    index = next(i for i, row in enumerate(rows) if isinstance(row[4], Preempted))
    actor, seq, mono, _, event = rows[index]
    for wall, waits in ((0.105, [(110_000, 200_000)]), (0.095, [(95_000, 100_000), (110_000, 200_000)])):
        rows[index] = (actor, seq, mono, 100.0 + wall, event)  # while step 2 (0.100-0.110) runs, or before
        events = check_covers(chrome_trace(rows), rows)
        slices = _request_slices(events)
        assert [(start, end) for name, start, end, _ in slices if name == "decode"] == [(100_000, 110_000)]
        assert [(start, end) for name, start, end, _ in slices if name == "queued (preempted)"] == waits


def test_replicas_have_their_own_step_ids() -> None:
    """Data parallelism: "scheduler@1" plans the steps of "worker-0@1", numbered on their own; a
    request of replica 1 sits on replica 1's step of that id, not on replica 0's."""
    rows = _story()
    twin = []
    for actor, seq, mono, wall, event in rows:
        if actor in ("scheduler", "kv_cache_manager", "worker-0"):
            if hasattr(event, "request_id"):
                event = msgspec.structs.replace(event, request_id="b")
            if isinstance(event, Tokens):
                event = msgspec.structs.replace(event, request_ids=["b"])
            if isinstance(event, StepFinished):
                event = msgspec.structs.replace(event, execute_ms=2.0)  # replica 1's steps: 2 ms
            twin.append((f"{actor}@1", seq, mono, wall, event))
    rows += twin
    events = check_covers(chrome_trace(rows), rows)
    tid_of = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    chunk = next(e for e in events if e["name"] == "prefill" and e["tid"] == tid_of["b"])
    assert (chunk["ts"], chunk["ts"] + chunk["dur"]) == pytest.approx((68_000, 70_000))  # worker-0@1's step 0
    ends = {e["tid"] for e in events if e["ph"] == "f"}
    assert ends == {tid_of["worker-0"], tid_of["worker-0@1"]}


def test_the_summary_says_where_a_late_request_spent_its_time(tmp_path: Path) -> None:
    from vllm_actors.observe.trace_summary import main, summary_text

    rows = _story()
    actor, seq, mono, wall, _ = rows[0]
    rows[0] = (actor, seq, mono, wall, _ArrivedWithTargets(request_id="a", num_prompt_tokens=40, max_tokens=3,
                                                            ttft_target_ms=50.0))
    text = summary_text(chrome_trace(rows))  # type: ignore[arg-type]
    assert text.splitlines() == [
        "1 requests in the trace (1 in the log)",
        "TTFT target met by 0 of 1 with one; end-to-end target missed by 0",
        "1 missed their TTFT target, latest first:",
        "- a: TTFT 91.0 ms (target 50 ms): waited 138.0 ms; preempted 1x; prefill in 3 chunk(s), 30.0 ms, sharing "
        "steps of up to 42 tokens (step 3); longest decode step 10.0 ms (step 2, 1 tokens)",
    ]
    assert summary_text(chrome_trace(_story())).splitlines()[1] == "1 slowest to their first token:"
    # a trace merged into runs names no step (it once said "longest decode step 3745.4 ms (step -1, 0 tokens)")
    merged = summary_text(chrome_trace(rows, TraceOptions(detail="runs")))  # type: ignore[arg-type]
    assert merged.splitlines()[-1].endswith("decoded in 1 run(s) of 1 steps in all, the slowest 10.0 ms per step")
    assert "step -1" not in merged
    write_trace(rows, tmp_path / "t.json.gz", max_bytes=None)  # type: ignore[arg-type]
    assert main([str(tmp_path / "t.json.gz"), "--top", "1"]) == 0


def test_host_tier_moves_are_instants_and_a_counter() -> None:
    """A long prompt's write-through copies and a later restore: each an instant on the KV-cache
    manager's thread and a point of the ``host kv`` counter (slots cached and free)."""
    rows: list[tuple[str, int, float, float, object]] = [
        ("kv_cache_manager", 0, 0.0, 100.0, BlockOffloaded(copies=[0, 0, 4], num_blocks=4, num_host_cached=4,
                                                           num_host_blocks=10, write_through=True)),
        ("kv_cache_manager", 1, 0.5, 100.5, BlockRestored(copies=[0, 7, 2], num_blocks=2, num_host_cached=4,
                                                          num_host_blocks=10)),
    ]
    events = check_covers(chrome_trace(rows), rows)
    instants = [e["name"] for e in events if e["ph"] == "i"]
    assert instants == ["BLOCK_OFFLOADED", "BLOCK_RESTORED"]
    host = [(e["ts"], e["args"]) for e in events if e["ph"] == "C" and e["name"] == "host kv"]
    assert host == [(0.0, {"cached": 4, "free": 6}), (500_000.0, {"cached": 4, "free": 6})]
