"""The exchange benchmark of KV borrowing (``benchmarks/kv_borrow_exchange.py``) at a tiny shape on the
CPU: its two real processes (a home and a lender over gloo) run every phase under each busy mode asked
for, and its report holds the round trip, the floor, the attention alone and both sides' parts, the
times positive. Its ranks are killed if they outlive its timeout, and gone when it returns."""

from __future__ import annotations

import json
import multiprocessing
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.kv_borrow_exchange import HOME_PARTS, main

TINY = ["--cpu", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "8", "--lent-tokens", "300",
        "--block-size", "16", "--steps", "3", "--tokens", "1", "8", "--busy-lender", "none", "python"]


def test_a_tiny_exchange_reports_every_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kvx.json"
    assert main([*TINY, "--timeout", "60", "--out", str(out)]) == 0  # past its timeout it raises
    assert not multiprocessing.active_children()  # both ranks joined
    report = json.loads(out.read_text())
    assert report["device"] == "cpu" and report["lent_tokens"] == 304  # whole blocks: 19 of 16
    rows = report["rows"]
    assert [(row["tokens"], row["busy"]) for row in rows] == [(1, "none"), (8, "none"), (1, "python"), (8, "python")]
    for row in rows:
        assert row["calls"] == 3 * 2
        assert row["payload_bytes"] == row["tokens"] * (2 + 2 * 1) * 8 * 4  # float32 q, k, v packed
        assert row["reply_bytes"] == row["tokens"] * 2 * (8 + 1) * 4
        home, lender = row["home_ms"], row["lender_ms"]
        assert set(HOME_PARTS) | {"round_trip"} <= set(home)
        assert {"recv_wait", "recv", "alloc", "h2d", "attend", "attend_sync", "d2h", "send", "other", "answer",
                "total"} <= set(lender)
        # under shared memory (the default) nothing is allocated a call: alloc stays 0
        assert home["alloc"]["mean"] == lender["alloc"]["mean"] == 0 and report["transport"] == "shm"
        for timed in (home["round_trip"], row["pingpong_ms"], row["inproc_ms"]["attend"], lender["attend"],
                      lender["answer"], home["send"], home["wait"], lender["send"]):
            assert 0 < timed["p50"] <= timed["p90"] and timed["mean"] > 0
        # the parts are exclusive times: none exceeds its call (up to the clock's and the percentiles' slack)
        assert all(home[part]["mean"] <= home["round_trip"]["mean"] + 1e-3 for part in HOME_PARTS if part != "other")
        assert lender["answer"]["mean"] <= lender["total"]["mean"] + 1e-9
        if row["busy"] == "python":
            assert row["exchange_busy_iterations"] > 0  # the main thread polled while the thread answered
    printed = capsys.readouterr().out
    assert "home's parts" in printed and "lender's parts" in printed


def test_ranks_that_outlive_the_timeout_are_killed(tmp_path: Path) -> None:
    """A run far too long for its timeout: an error, and no rank left behind."""
    with pytest.raises(TimeoutError):  # 100,000 steps: minutes on any machine
        main([*TINY, "--steps", "100000", "--timeout", "3", "--out", str(tmp_path / "kvx.json")])
    assert not multiprocessing.active_children()
    assert not (tmp_path / "kvx.json").exists()
