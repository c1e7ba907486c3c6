"""``benchmarks/long_context.py --trace`` without an engine: the chunk table of one prefill built
from synthetic store events (two stages and one), its markdown, and the capture from a store that
receives the request's last events late (EventsQuery pages); the GPU's times (STEP_TIMED) where the
workers measured them, the host's elsewhere."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib.long_context_chunks import MARKDOWN_ROWS, chunk_markdown, chunk_table
from benchmarks.lib.long_context_trace import capture, is_complete, request_window

from vllm_actors.observe.trace import TraceRow
from vllm_actors.protocol.events import (
    Arrived,
    Event,
    Finished,
    FirstToken,
    PrefillChunk,
    Queued,
    Scheduled,
    StepFinished,
    StepTimed,
)
from vllm_actors.protocol.metrics import EventsQuery, EventsReply, MetricsQuery, MetricsReply, TimelineEntry

T0 = 1_700_000_000.0
STEP = 0.010  # seconds a chunk takes on each stage
CHUNKS = (64, 40, 24)


def _rows(stages: int, other: str = "other") -> list[TraceRow]:
    """Another request's late step, then request "r" (144 prompt tokens, 16 cached): three chunks
    back to back through ``stages`` stages, each starting as the stage before finishes it, 2 ms gaps
    on stage 0 between chunks; a second worker of stage 0 (a TP rank reporting too) is ignored."""
    events: list[tuple[str, float, Event]] = [
        ("worker-0", T0 - 0.5, StepFinished(step_id=1, num_seqs=1, num_tokens=1, num_sampled=1, execute_ms=1.0)),
        ("frontend", T0, Arrived(request_id="r", num_prompt_tokens=144, max_tokens=4)),
        ("scheduler", T0 + 0.001, Queued(request_id="r", num_waiting=1)),
        ("scheduler", T0 + 0.001, Scheduled(request_id="r", step_id=10, num_query_tokens=144, num_cached_tokens=16)),
        ("frontend", T0 + 0.002, Arrived(request_id=other, num_prompt_tokens=1, max_tokens=1)),
    ]
    start = 16
    for chunk, tokens in enumerate(CHUNKS):
        events.append(("scheduler", T0 + 0.001, PrefillChunk(request_id="r", step_id=10 + chunk, start=start,
                                                             num_tokens=tokens, last=chunk == len(CHUNKS) - 1)))
        start += tokens
        begin = T0 + 0.005 + chunk * (STEP + 0.002)
        for stage in range(stages):
            end = begin + (stage + 1) * STEP
            samples = stage == stages - 1 and chunk == len(CHUNKS) - 1  # the last chunk's last stage
            finished = StepFinished(step_id=10 + chunk, num_seqs=1, num_tokens=tokens, num_sampled=int(samples),
                                    execute_ms=STEP * 1e3, stage=None if stage == stages - 1 else stage)
            events.append((f"worker-{stage}", end, finished))
            if stage == 0:
                events.append((f"worker-{stages}", end, StepFinished(
                    step_id=10 + chunk, num_seqs=1, num_tokens=tokens, num_sampled=0, execute_ms=99.0,
                    stage=finished.stage)))
    last = T0 + 0.005 + (len(CHUNKS) - 1) * (STEP + 0.002) + stages * STEP
    events += [("scheduler", last + 0.001, FirstToken(request_id="r", step_id=12)),
               ("scheduler", last + 0.002, Finished(request_id="r", reason="length", num_prompt_tokens=144,
                                                            num_output_tokens=4)),
               ("worker-0", last + 0.5, StepFinished(step_id=20, num_seqs=1, num_tokens=1, num_sampled=1,
                                                     execute_ms=1.0))]
    seqs: dict[str, int] = {}
    rows: list[TraceRow] = []
    for actor, wall, event in sorted(events, key=lambda item: item[1]):
        seqs[actor] = seqs.get(actor, -1) + 1
        rows.append((actor, seqs[actor], wall, wall, event))
    return rows


def test_the_chunk_table_of_a_prefill_over_two_stages() -> None:
    table = chunk_table(_rows(2), "r", 2)
    assert (table["num_chunks"], table["num_stages"], table["prompt_tokens"], table["cached_tokens"]) == (3, 2, 144, 16)
    assert table["computed_tokens"] == sum(CHUNKS) == 144 - 16
    assert table["ideal_time_ratio"] == pytest.approx(4 / 6) and table["ideal_bubble_fraction"] == pytest.approx(1 / 4)
    assert [row["tokens"] for row in table["chunks"]] == list(CHUNKS)
    assert [row["start"] for row in table["chunks"]] == [16, 80, 120]
    first, second = table["chunks"][0]["stages"], table["chunks"][1]["stages"]
    assert first[0] == {"start_ms": pytest.approx(5.0), "end_ms": pytest.approx(15.0), "execute_ms": 10.0,
                        "gap_ms": None, "basis": "host"}
    assert table["basis"] == {"gpu": 0, "host": 6}
    assert first[1]["start_ms"] == pytest.approx(15.0) and first[1]["end_ms"] == pytest.approx(25.0)
    assert second[0]["gap_ms"] == pytest.approx(2.0) and second[1]["gap_ms"] == pytest.approx(2.0)
    stage0, stage1 = table["stages"]
    assert (stage0["worker"], stage1["worker"]) == ("worker-0", "worker-1")  # worker-2's rank-1 report left out
    assert stage0["gap_ms"] == pytest.approx(4.0) and stage0["busy_ms"] == pytest.approx(30.0)
    # the window: 5 ms to 49 ms; each stage busy 30 ms of it (PipelineBubbles' reckoning)
    assert stage0["bubble_fraction"] == pytest.approx(14 / 44, rel=1e-4)
    assert stage1["bubble_fraction"] == pytest.approx(14 / 44, rel=1e-4)
    assert table["prefill_ms"] == pytest.approx(44.0) and table["first_token_ms"] == pytest.approx(50.0)

    lines = chunk_markdown("144", {"file": "trace-ours-144.json.gz", "chunks": table})
    assert "3 chunks of 128 computed tokens over 2 stage(s)" in lines[1] and "0.67" in lines[1]
    assert "| chunk | tokens | s0 start | s0 end | s0 exec | s0 gap | s1 start |" in "\n".join(lines)
    assert "| 1 | 40 | 17.00 | 27.00 | 10.00 | 2.00 | 27.00 | 37.00 | 10.00 | 2.00 |" in lines
    assert "bubble fraction 31.8%" in lines[2]
    assert "times: the host's (STEP_FINISHED" in lines[1] and "*" not in "\n".join(lines[4:])


GPU_MS = 6.0  # each chunk's time on the GPU: its host time (10 ms) was launch to read-back


def _with_gpu_times(rows: list[TraceRow], stages: int) -> list[TraceRow]:
    """STEP_TIMED of every chunk on every stage but the last stage's last chunk (it samples: its
    read-back waits for it), each starting where the host's time said and lasting 6 ms; a TP rank-1
    worker's too (left out)."""
    timed: list[TraceRow] = []
    for chunk in range(len(CHUNKS)):
        for stage in range(stages):
            if stage == stages - 1 and chunk == len(CHUNKS) - 1:
                continue
            start = T0 + 0.005 + chunk * (STEP + 0.002) + stage * STEP
            event = StepTimed(step_id=10 + chunk, stage=None if stage == stages - 1 else stage, gpu_ms=GPU_MS,
                              gpu_start=start, gpu_end=start + GPU_MS / 1e3)
            published = start + 0.05
            timed.append((f"worker-{stage}", 1_000 + len(timed), published, published, event))
            if stage == 0:
                timed.append((f"worker-{stages}", 1_000 + len(timed), published, published,
                              StepTimed(step_id=10 + chunk, stage=event.stage, gpu_ms=99.0, gpu_start=start,
                                        gpu_end=start + 0.099)))
    return sorted(rows + timed, key=lambda row: row[3])


def test_the_gpus_times_replace_the_hosts_where_measured() -> None:
    rows = _with_gpu_times(_rows(2), 2)
    table = chunk_table(rows, "r", 2)
    assert table["basis"] == {"gpu": 5, "host": 1}
    first, last = table["chunks"][0]["stages"], table["chunks"][2]["stages"]
    assert first[0] == {"start_ms": pytest.approx(5.0), "end_ms": pytest.approx(11.0), "execute_ms": GPU_MS,
                        "gap_ms": None, "basis": "gpu"}
    assert first[1]["start_ms"] == pytest.approx(15.0) and first[1]["end_ms"] == pytest.approx(21.0)
    assert table["chunks"][1]["stages"][0]["gap_ms"] == pytest.approx(6.0)  # 11 ms to 17 ms: idle on the GPU
    assert last[1] == {"start_ms": pytest.approx(39.0), "end_ms": pytest.approx(49.0), "execute_ms": 10.0,
                       "gap_ms": pytest.approx(6.0), "basis": "host"}  # sampled: the host's time is true
    stage0, stage1 = table["stages"]
    assert stage0["busy_ms"] == pytest.approx(18.0) and stage1["busy_ms"] == pytest.approx(22.0)
    # the window still 5 ms to 49 ms; busy on the GPU 18 ms and 12 + 10 ms of it
    assert stage0["bubble_fraction"] == pytest.approx(1 - 18 / 44, rel=1e-4)
    assert stage1["bubble_fraction"] == pytest.approx(1 - 22 / 44, rel=1e-4)

    lines = chunk_markdown("144", {"chunks": table})
    assert "times: the GPU's (STEP_TIMED, CUDA events) for 5 of 6 stage steps" in lines[1]
    assert "| 2 | 24 | 29.00 | 35.00 | 6.00 | 6.00 | 39.00 | 49.00 | 10.00* | 6.00 |" in lines
    one_stage = chunk_table(_with_gpu_times(_rows(1), 1), "r", 1)
    assert one_stage["basis"] == {"gpu": 2, "host": 1}


def test_the_capture_waits_for_the_gpu_times_once_the_workers_send_them() -> None:
    rows = _with_gpu_times(_rows(2), 2)
    assert is_complete(rows, "r", 2)
    late = [row for row in rows
            if not (isinstance(row[4], StepTimed) and row[4].step_id == 11 and row[0] == "worker-1")]
    assert not is_complete(late, "r", 2)  # chunk 1's on stage 1 not in yet
    assert is_complete(_rows(2), "r", 2)  # no GPU times at all (a CPU run): the host's are the whole story


def test_one_stage_still_has_its_table_and_a_missing_step_shows() -> None:
    rows = _rows(1)
    table = chunk_table(rows, "r", 1)
    assert table["num_chunks"] == 3 and table["ideal_time_ratio"] == 1.0 and table["ideal_bubble_fraction"] == 0.0
    assert table["stages"][0]["bubble_fraction"] == pytest.approx(4 / 34, rel=1e-4)  # two 2 ms gaps in 34 ms
    gone = [row for row in rows if not (isinstance(row[4], StepFinished) and row[4].step_id == 11)]
    table = chunk_table(gone, "r", 1)
    assert table["chunks"][1]["stages"] == [None] and table["chunks"][2]["stages"][0]["gap_ms"] is None
    assert "| 1 | 40 | - | - | - | - |" in chunk_markdown("144", {"chunks": table})
    with pytest.raises(ValueError, match="no ARRIVED"):
        chunk_table(rows, "absent", 1)
    with pytest.raises(ValueError, match="num_stages"):
        chunk_table(rows, "r", 0)


def test_markdown_of_a_long_prefill_shows_its_ends_and_of_a_failed_capture_why() -> None:
    chunks = [{"chunk": i, "step_id": i, "start": i, "tokens": 1, "stages": [None]} for i in range(100)]
    table = {"request_id": "r", "num_stages": 1, "num_chunks": 100, "computed_tokens": 100, "ideal_time_ratio": 1.0,
             "ideal_bubble_fraction": 0.0, "prefill_ms": None, "first_token_ms": None, "chunks": chunks,
             "stages": [{"stage": 0, "worker": None, "steps": 0, "busy_ms": 0.0, "gap_ms": 0.0,
                         "bubble_fraction": None}]}
    lines = chunk_markdown("1M", {"chunks": table})
    body = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert len(body) == MARKDOWN_ROWS and body[0].startswith("| 0 |") and body[-1].startswith("| 99 |")
    assert any(f"{100 - MARKDOWN_ROWS} chunks more" in line for line in lines)
    assert "not traced (RuntimeError: no store)" in chunk_markdown("1M", {"error": "RuntimeError: no store"})[1]


def test_capture_waits_for_the_last_events_and_keeps_the_requests_window(tmp_path: Path) -> None:
    rows = _rows(2)
    late = next(i for i, row in enumerate(rows) if isinstance(row[4], Finished))  # the store has up to here at first
    log = [TimelineEntry(actor=a, seq=s, mono=m, wall=w, type="", event=e) for a, s, m, w, e in rows]
    caught_up: list[int] = []  # the store receives the rest once the capture has read what it had

    def query(message: MetricsQuery) -> MetricsReply:
        assert isinstance(message, EventsQuery)
        held = log if caught_up else log[:late]
        start = max(message.since_index, 0)
        found = held[start:start + min(message.limit, 2)]  # two a page
        if not found:
            caught_up.append(start)
        return EventsReply(first_index=start, next_index=start + len(found), missed=0, events=found)

    assert not is_complete(rows[:late], "r", 2) and is_complete(rows, "r", 2)
    record = capture(query, 1, "r", 2, tmp_path / "t.json.gz", wait_s=30.0)
    assert record["complete"] and record["missed_events"] == 0 and record["file"] == "t.json.gz"
    assert caught_up[0] == late  # read to the end of what it held first, then on from there
    window = request_window(rows[1:], "r")
    assert window[0][4] == rows[1][4] and isinstance(window[-1][4], Finished)  # the steps before and after left out
    assert record["trace"]["num_events"] == len(window) and record["chunks"]["num_chunks"] == 3
    trace = json.loads(gzip.decompress((tmp_path / "t.json.gz").read_bytes()))
    assert trace["otherData"]["pipeline_bubbles"].keys() == {"stage 0", "stage 1"}
