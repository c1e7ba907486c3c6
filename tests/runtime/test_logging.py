"""Logging set-up: key=value lines on whatever stderr currently is."""

from __future__ import annotations

import io
import sys

import pytest
import structlog

from vllm_actors.runtime.log_setup import configure_logging


def test_logging_follows_a_replaced_and_closed_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    # Regression: the logger once held the stderr of configuration time; pytest closes each test's
    # captured stream, and a later log line raised "I/O operation on closed file".
    configure_logging("INFO")
    try:
        first = io.StringIO()
        monkeypatch.setattr(sys, "stderr", first)
        structlog.get_logger("test").info("first line")
        assert "first line" in first.getvalue()
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        structlog.get_logger("test").info("second line", key="value")
        assert "second line" in second.getvalue() and "key=value" in second.getvalue()
    finally:
        configure_logging()
