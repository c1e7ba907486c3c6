"""The recovery benchmark's victim and verdicts (`benchmarks/lib/recovery.py`); the kill and the
restart under load are tested through the process group in tests/process_group (the TP rank and
the PP stage SIGKILL tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the repository, for the developer benchmarks' code (benchmarks.lib)
sys.path.insert(0, str(next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())))

from benchmarks.lib.recovery import _failures, main
from benchmarks.lib.recovery_run import victim_actor


def test_the_victim_is_a_rank_of_the_first_stage_or_a_stage_s_first_rank() -> None:
    assert victim_actor("rank", 0, 1, 1) == "worker-0"
    assert victim_actor("rank", 1, 2, 1) == "worker-1"
    assert victim_actor("stage", 1, 1, 2) == "worker-1"
    assert victim_actor("stage", 1, 2, 2) == "worker-2"  # ranks run stage by stage: stage 1 starts at rank 2
    with pytest.raises(ValueError, match="a pipeline stage from 0 to 0"):
        victim_actor("stage", 1, 2, 1)
    with pytest.raises(ValueError, match="a tensor-parallel rank from 0 to 1"):
        victim_actor("rank", 2, 2, 2)


def test_a_bad_kill_index_is_refused_before_any_process_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--kill-role", "stage", "--kill-index", "1"])
    assert "--kill-index 1: a pipeline stage from 0 to 0 (--pipeline-parallel-size 1)" in capsys.readouterr().err


def test_a_lost_request_a_hang_or_a_process_left_fails_the_kill() -> None:
    fine = {"killed": True, "hung": False, "requests_lost": 0, "old_processes_alive": [], "serving_again_seconds": 1.0}
    assert _failures(fine) == []
    assert _failures(fine | {"requests_lost": 2}) == ["2 requests lost (not finished with every token)"]
    assert "still alive: ['worker-0']" in _failures(fine | {"old_processes_alive": ["worker-0"]})[0]
    assert "did not finish within --timeout" in _failures(fine | {"hung": True})[0]
    assert _failures(fine | {"serving_again_seconds": None}) == ["no token was generated after the restart"]
