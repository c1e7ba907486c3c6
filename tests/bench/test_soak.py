"""The soak script's pure parts: the request mix it builds and the verdict it draws."""

from __future__ import annotations

import json
import random

import pytest

from vllm_actors.bench.soak import _actor_name, group_processes
from vllm_actors.bench.soak_load import WEIGHTS, make_shot
from vllm_actors.bench.soak_report import Sample, Tally, baseline_sample, build_report, format_markdown


@pytest.mark.parametrize("kind", sorted(set(WEIGHTS) - {"clash"}))
def test_every_kind_of_shot_is_built(kind: str) -> None:
    shot = make_shot(kind, random.Random(1), "m", 4)
    assert shot.kind == kind and shot.path in ("/v1/completions", "/v1/chat/completions")
    if kind in ("completion", "chat", "invalid", "long_id", "disconnect"):
        body = json.loads(shot.content)
        assert body["model"] == "m" or kind == "invalid"
    if kind == "huge":
        assert 29 * 1024 * 1024 < len(shot.content) <= 32 * 1024 * 1024
    if kind == "long_id":
        assert len(shot.headers["X-Request-Id"]) >= 10_000
    assert shot.leave_after_first_chunk == (kind == "disconnect")


def _sample(minute: float, rss: dict[str, float], kv: int | None = 0) -> Sample:
    return Sample(minute=minute, rss_mb=rss, pids={name: 1 for name in rss}, kv_blocks_in_use=kv, running=0,
                  waiting=0)


def _tallies(valid_answered: int = 10, server_errors: int = 0) -> dict[str, Tally]:
    chat = Tally()
    for i in range(10):
        chat.count(200, i < valid_answered, None)
    invalid = Tally()
    invalid.count(400, False, None)
    for _ in range(server_errors):
        invalid.count(500, False, "status 500")
    return {"chat": chat, "invalid": invalid}


def test_a_clean_run_passes_and_each_criterion_can_fail() -> None:
    samples = [_sample(0, {"serve": 50, "scheduler": 30}), _sample(5, {"serve": 100, "scheduler": 40})]
    flat = _sample(30, {"serve": 105, "scheduler": 40})
    report = build_report(30, 64, _tallies(), samples, flat)
    assert report.passed, report.criteria
    assert "PASS" in format_markdown(report) and "| memory flat: serve | ok |" in format_markdown(report)

    failed = {c.name for c in build_report(30, 64, _tallies(valid_answered=9, server_errors=2), samples,
                                           _sample(30, {"serve": 120, "scheduler": 40}, kv=3)).criteria
              if not c.passed}
    assert failed == {"every valid request answered", "no response >= 500", "KV pool empty at the end",
                      "memory flat: serve"}
    hung = _tallies()
    hung["chat"].count(None, False, "hang")
    assert not build_report(30, 64, hung, samples, flat).passed


def test_the_baseline_is_the_minute_asked_for_or_the_first_sample() -> None:
    samples = [_sample(0, {}), _sample(4.9, {}), _sample(5.1, {}), _sample(6, {})]
    assert baseline_sample(samples, 5).minute == 5.1
    assert baseline_sample(samples[:2], 5).minute == 0
    assert baseline_sample([], 5) is None


def test_the_process_tree_names_this_process() -> None:
    import os

    processes = group_processes(os.getpid())
    assert processes["serve"] == os.getpid()
    assert _actor_name(os.getpid()).startswith("pid-")
