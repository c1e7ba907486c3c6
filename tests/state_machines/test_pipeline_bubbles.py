"""The pipeline's bubble fraction per stage, from every stage's STEP_FINISHED: busy time over the
pipeline's working time (the union of the stages' steps, short gaps in, idle periods out), in
``stats`` (the summary and its text) and in the Chrome trace, whose stage tracks show the gaps."""

from __future__ import annotations

import pytest

from tests.state_machines.test_metrics_store import Bus, summary
from vllm_actors.actors.metrics_store.bubbles import IDLE_GAP, MAX_OPEN, PipelineBubbles
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.observe.stats_text import summary_text
from vllm_actors.observe.trace import ACTORS_PID, chrome_trace
from vllm_actors.protocol.events import StepFinished
from vllm_actors.protocol.metrics import SummaryQuery, SummaryReply

STEP = 0.01  # seconds per chunk on every stage


def approx(expected: object) -> object:
    return pytest.approx(expected, rel=1e-4)  # batches' wall clocks are seconds since 1970: 1e-7 s apart


def _finished(step_id: int, stage: int | None, seconds: float = STEP) -> StepFinished:
    return StepFinished(step_id=step_id, num_seqs=1, num_tokens=64, num_sampled=0 if stage is not None else 1,
                        execute_ms=seconds * 1e3, stage=stage)


def _spp_prefill(bus: Bus, start: float, chunks: int = 10, suffix: str = "") -> None:
    """``chunks`` chunks through two stages back to back: stage 0 runs chunk i while stage 1 runs i - 1."""
    for chunk in range(chunks + 1):
        if chunk < chunks:
            bus.publish(f"worker-0{suffix}", _finished(chunk, 0), at=start + (chunk + 1) * STEP)
        if chunk:
            bus.publish(f"worker-1{suffix}", _finished(chunk - 1, None), at=start + (chunk + 1) * STEP)


def test_each_stages_bubble_fraction_is_its_idle_share_of_the_pipelines_time() -> None:
    store = MetricsStore()
    bus = Bus(store)
    _spp_prefill(bus, 0.0)
    # 10 chunks over 2 stages: each stage idles one chunk's time of the 11 (the fill or the drain)
    assert summary(store).pipeline_bubbles == approx({"stage 0": 1 / 11, "stage 1": 1 / 11})
    _spp_prefill(bus, 5.0)  # after an idle period, which is no bubble
    reply = summary(store)
    assert reply.pipeline_bubbles == approx({"stage 0": 1 / 11, "stage 1": 1 / 11})
    assert reply.steps == 20  # the earlier stage's events still count no step
    assert "pipeline   bubble fraction stage 0 9.1%, stage 1 9.1%" in summary_text(reply)


def test_a_stage_waiting_for_its_input_is_in_a_bubble() -> None:
    store = MetricsStore()
    bus = Bus(store)
    for step in range(4):  # decodes: each step waits for the token of the one before (no overlap)
        bus.publish("worker-0", _finished(step, 0), at=step * 3 * STEP + STEP)
        bus.publish("worker-1", _finished(step, None), at=step * 3 * STEP + 2 * STEP)
    # each stage busy 4 step times of the window's 11: every step of one stage waits for the other
    # stage's and a round trip to the scheduler (a step's time here, under IDLE_GAP: in the window)
    assert summary(store).pipeline_bubbles == approx({"stage 0": 7 / 11, "stage 1": 7 / 11})


def test_no_pipeline_no_bubbles_and_replicas_apart() -> None:
    store = MetricsStore()
    bus = Bus(store)
    for step in range(3):
        bus.publish("worker-0", _finished(step, None), at=(step + 1) * STEP)
    assert summary(store).pipeline_bubbles == {}
    _spp_prefill(bus, 1.0, suffix="@1")
    assert summary(store).pipeline_bubbles == approx({"stage 0@1": 1 / 11, "stage 1@1": 1 / 11})
    own = store.query(SummaryQuery(replica=1))
    assert isinstance(own, SummaryReply) and own.pipeline_bubbles == approx({"stage 0@1": 1 / 11,
                                                                                   "stage 1@1": 1 / 11})


def test_the_window_merges_late_steps_and_stays_bounded() -> None:
    bubbles = PipelineBubbles()
    for burst in range(2 * MAX_OPEN):  # bursts far apart: each its own span until the oldest close
        at = burst * 10 * IDLE_GAP
        bubbles.step("worker-1", at + 2 * STEP, _finished(1, None))
        bubbles.step("worker-0", at + STEP, _finished(0, 0))  # reported after the later step: merged
    assert len(bubbles._pipelines[None].window.starts) <= MAX_OPEN
    assert bubbles._pipelines[None].window.seconds == approx(2 * MAX_OPEN * 2 * STEP)
    assert bubbles.fractions() == approx({"stage 0": 0.5, "stage 1": 0.5})


def test_the_trace_shows_each_stages_track_with_its_bubbles() -> None:
    bus = Bus()
    _spp_prefill(bus, 0.0, chunks=4)
    rows = [(batch.actor, batch.first_seq + index, batch.mono, batch.wall, event)
            for batch in bus.batches for index, event in enumerate(batch.events)]
    trace = chrome_trace(rows)
    names = {event["tid"]: event["args"]["name"] for event in trace["traceEvents"]
             if event["ph"] == "M" and event["name"] == "thread_name" and event["pid"] == ACTORS_PID}
    slices: dict[str, list[tuple[float, float]]] = {}
    for event in trace["traceEvents"]:
        if event["ph"] == "X" and event["pid"] == ACTORS_PID:
            slices.setdefault(names[event["tid"]], []).append((event["ts"], event["ts"] + event["dur"]))
    assert len(slices["worker-0"]) == len(slices["worker-1"]) == 4
    # stage 1 starts one chunk after stage 0 (its fill bubble); stage 0 ends one chunk before (drain)
    assert slices["worker-1"][0][0] == approx(slices["worker-0"][0][1])
    assert slices["worker-0"][-1][1] == approx(slices["worker-1"][-1][0])
    assert trace["otherData"]["pipeline_bubbles"] == approx({"stage 0": 1 / 5, "stage 1": 1 / 5})
