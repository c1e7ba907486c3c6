"""The chaos tool: its arguments, its report's arithmetic on made-up runs, and a short run with no
faults on the tiny model (the recovery itself is exercised by running the tool after the merge)."""

from __future__ import annotations

import asyncio
import json
import random
import signal
from pathlib import Path

import pytest

from vllm_actors.bench.chaos import (
    DEFAULT_ACTORS,
    ChaosOptions,
    build_parser,
    make_prompts,
    next_fault_delay,
    options_from_args,
    pick_fault,
    run_chaos,
    sampling_for,
)
from vllm_actors.bench.chaos_report import (
    Fault,
    RequestRun,
    Restart,
    build_report,
    first_divergence,
    format_table,
    match_restarts,
    summarize_seconds,
)
from vllm_actors.cli import build_parser as cli_parser


# --------------------------------------------------------------------------- arguments
def test_defaults_and_flags() -> None:
    options = options_from_args(build_parser().parse_args([]))
    assert options.actors == DEFAULT_ACTORS and options.model is None and options.engine["device"] == "cpu"
    assert (options.duration, options.kill_every, options.stop_prob, options.reference) == (60.0, 15.0, 0.0, True)
    args = build_parser().parse_args([
        "--model", "m", "--duration", "5", "--kill-every", "0.5", "--actors", "worker-0, scheduler", "--stop-prob",
        "0.25", "--stop-seconds", "2", "--concurrency", "3", "--hang-timeout", "9", "--no-reference", "--json",
        "out.json", "--dtype", "float32", "--chaos-seed", "7"])
    options = options_from_args(args)
    assert options.actors == ("worker-0", "scheduler") and options.model == "m"
    assert (options.kill_every, options.stop_prob, options.stop_seconds, options.concurrency) == (0.5, 0.25, 2.0, 3)
    assert (options.hang_timeout, options.reference, options.json_path, options.seed) == (9.0, False, "out.json", 7)
    assert options.engine["dtype"] == "float32"
    # the same through the command line's subcommand
    cli = cli_parser().parse_args(["chaos", "--kill-every", "0", "--duration", "3"])
    assert cli.command == "chaos" and cli.kill_every == 0 and cli.duration == 3


@pytest.mark.parametrize("flags", [["--stop-prob", "1.5"], ["--concurrency", "0"], ["--duration", "0"],
                                   ["--kill-every", "-1"], ["--actors", ","]])
def test_nonsense_is_refused(flags: list[str]) -> None:
    with pytest.raises(ValueError):
        options_from_args(build_parser().parse_args(flags))


def test_workload_and_fault_draws_are_reproducible() -> None:
    assert make_prompts(5, 3) == make_prompts(5, 3) and len(set(make_prompts(20, 3))) == 20
    assert sampling_for(0, 8, 1).temperature == 0.0
    seeded = sampling_for(1, 8, 1)
    assert seeded.temperature > 0 and seeded.seed is not None and seeded.ignore_eos and seeded.max_tokens == 8
    rng = random.Random(0)
    delays = [next_fault_delay(rng, 2.0) for _ in range(4000)]
    assert 1.8 < sum(delays) / len(delays) < 2.2  # exponential with the asked mean
    picks = [pick_fault(rng, ("a", "b"), 0.3) for _ in range(2000)]
    assert {actor for actor, _ in picks} == {"a", "b"}
    stops = sum(how is signal.SIGSTOP for _, how in picks) / len(picks)
    assert 0.25 < stops < 0.35


# --------------------------------------------------------------------------- report arithmetic
def run(request_id: str, prompt: int, start: float, end: float | None, tokens: list[int],
        reason: str | None = "length", **extra: object) -> RequestRun:
    return RequestRun(request_id=request_id, prompt_index=prompt, start=start, end=end, token_ids=tokens,
                      finish_reason=reason, **extra)  # type: ignore[arg-type]


def test_report_counts_outcomes_recoveries_and_divergences() -> None:
    reference = {0: [1, 2, 3], 1: [4, 5, 6]}
    runs = [
        run("a", 0, 100.0, 101.0, [1, 2, 3]),  # before any fault
        run("b", 1, 100.5, 104.0, [4, 5, 6]),  # spans the fault at 102: recovered
        run("c", 0, 101.5, 103.0, [1, 9, 3]),  # spans it, differs at position 1
        run("d", 1, 103.0, 104.0, [4, 5]),  # spans the fault at 103.2; shorter: differs at 2
        run("e", 0, 103.0, 104.0, [1], reason="error"),  # failed
        run("f", 0, 103.0, None, [1], reason=None, hung=True),  # hung
        run("g", 1, 103.5, None, [], reason=None),  # lost
        run("h", 1, 103.5, 103.6, [], reason=None, error="EngineDeadError: gone"),  # failed
    ]
    faults = [Fault(actor="worker-0", pid=11, signal="SIGKILL", at=102.0),
              Fault(actor="scheduler", pid=12, signal="SIGSTOP", at=103.2)]
    restarts = [Restart(actor="worker-0", pid=21, attempt=1, seconds=1.5, at=104.5)]
    report = build_report(runs, faults, restarts, reference, started=100.0, ended=110.0,
                          kv_blocks_in_use=0, kv_blocks_total=64, pipeline_resets=1)
    assert report.requests == {"total": 8, "completed": 4, "failed": 2, "hung": 1, "lost": 1, "recovered": 3,
                               "differing": 2}
    assert [(d.request_id, d.position, d.got, d.expected) for d in report.divergences] == [
        ("c", 1, 9, 2), ("d", 2, None, 6)]
    assert report.errors == {"finish reason error": 1, "EngineDeadError: gone": 1}
    worker, scheduler = report.faults
    assert (worker.at, worker.recovered_after, worker.supervisor_seconds, worker.new_pid) == (2.0, 2.5, 1.5, 21)
    assert (worker.requests_spanning, scheduler.requests_spanning) == (2, 4)  # b, c; b, d, e, f (open to the end)
    assert scheduler.recovered_after is None and report.unrecovered_faults == 1
    assert report.recovery_seconds == {"count": 1, "mean": 2.5, "p50": 2.5, "max": 2.5}
    assert report.output_tokens == 3 + 3 + 3 + 2 and report.tokens_per_second == pytest.approx(11 / 10)
    assert not report.clean
    text = format_table(report)
    for fragment in ("completed 4 (recovered 3)", "failed 2, hung 1, lost 1", "differing from the reference 2",
                     "unrecovered 1", "0/64 blocks", "SIGSTOP", "NOT CLEAN", "differs: c (prompt 0) at token 1"):
        assert fragment in text, fragment
    assert json.loads(json.dumps(report.to_json()))["requests"]["lost"] == 1


def test_report_of_a_clean_run() -> None:
    runs = [run("a", 0, 0.0, 1.0, [1, 2]), run("b", 0, 0.5, 2.0, [1, 2])]
    faults = [Fault(actor="bus", pid=5, signal="SIGKILL", at=0.7)]
    restarts = [Restart(actor="scheduler", pid=6, attempt=1, seconds=0.1, at=0.8),  # another actor: not it
                Restart(actor="bus", pid=7, attempt=1, seconds=0.4, at=1.2)]
    report = build_report(runs, faults, restarts, {0: [1, 2]}, started=0.0, ended=2.0, kv_blocks_in_use=0,
                          kv_blocks_total=8)
    assert report.clean and report.faults[0].recovered_after == pytest.approx(0.5)
    assert report.requests["recovered"] == 2 and report.restarts_seen == {"scheduler": 1, "bus": 1}
    leaky = build_report(runs, [], [], None, started=0.0, ended=2.0, kv_blocks_in_use=3, kv_blocks_total=8)
    assert not leaky.clean and leaky.requests["differing"] == 0  # no reference: nothing compared


def test_report_helpers() -> None:
    assert first_divergence([1, 2], [1, 2]) is None
    assert first_divergence([1, 3], [1, 2]) == 1 and first_divergence([1], [1, 2]) == 1
    assert summarize_seconds([3.0, 1.0, 2.0, 4.0]) == {"count": 4, "mean": 2.5, "p50": 2.5, "max": 4.0}
    assert summarize_seconds([])["count"] == 0
    faults = [Fault(actor="a", pid=1, signal="SIGKILL", at=1.0), Fault(actor="a", pid=2, signal="SIGKILL", at=2.0)]
    restarts = [Restart(actor="a", pid=2, attempt=1, seconds=0.1, at=1.5),
                Restart(actor="a", pid=3, attempt=2, seconds=0.1, at=2.5)]
    assert [r.pid if r else None for r in match_restarts(faults, restarts)] == [2, 3]
    assert match_restarts(faults, restarts[:1])[1] is None


def test_a_stall_the_tool_ended_needs_no_restart() -> None:
    runs = [run("a", 0, 0.0, 3.0, [1, 2])]
    stall = Fault(actor="worker-0", pid=5, signal="SIGSTOP", at=1.0, continued_after=1.0)
    report = build_report(runs, [stall], [], {0: [1, 2]}, started=0.0, ended=3.0, kv_blocks_in_use=0,
                          kv_blocks_total=8)
    assert report.unrecovered_faults == 0 and report.clean and report.requests["recovered"] == 1
    assert "STALL" in format_table(report)
    never_continued = Fault(actor="worker-0", pid=5, signal="SIGSTOP", at=1.0)
    assert build_report(runs, [never_continued], [], None, started=0.0, ended=3.0).unrecovered_faults == 1


# --------------------------------------------------------------------------- a short run, no faults
def test_short_run_without_faults_is_clean(tiny_qwen3: Path, tmp_path: Path) -> None:
    options = ChaosOptions(
        model=str(tiny_qwen3), engine={"dtype": "float32", "num_gpu_blocks_override": 64, "device": "cpu"},
        duration=2.0, kill_every=0.0, concurrency=3, num_prompts=4, max_tokens=6, hang_timeout=30.0,
        idle_timeout=20.0,
    )
    report = asyncio.run(run_chaos(options))
    counts = report.requests
    assert counts["total"] >= 4 and counts["completed"] == counts["total"], format_table(report)
    assert counts["differing"] == 0 and counts["recovered"] == 0 and not report.faults
    assert report.kv_blocks_in_use_after_idle == 0 and report.kv_blocks_total == 64
    assert report.clean, format_table(report)
