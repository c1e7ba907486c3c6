"""Intra-op threads of a worker (runtime/worker_threads.py): CPU workers of one host share its
cores; GPU workers keep torch's default; the environment variable overrides both."""

from __future__ import annotations

import pytest

from vllm_actors.runtime.worker_threads import WORKER_THREADS_ENV, worker_threads


def test_cpu_workers_share_the_cores() -> None:
    assert worker_threads("cpu", 1, environ={}, cores=8) is None  # alone: torch's default (every core)
    assert worker_threads("cpu", 2, environ={}, cores=8) == 4
    assert worker_threads("cpu", 3, environ={}, cores=2) == 1  # never below one
    assert worker_threads("cpu", 4, environ={}, cores=2) == 1


def test_gpu_workers_keep_the_default() -> None:
    assert worker_threads("cuda", 8, environ={}, cores=16) is None


def test_the_environment_overrides() -> None:
    assert worker_threads("cuda", 2, environ={WORKER_THREADS_ENV: "3"}) == 3
    assert worker_threads("cpu", 1, environ={WORKER_THREADS_ENV: " 2 "}) == 2
    for bad in ("two", "0"):
        with pytest.raises(ValueError, match=WORKER_THREADS_ENV):
            worker_threads("cpu", 2, environ={WORKER_THREADS_ENV: bad})
