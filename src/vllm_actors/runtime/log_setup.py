"""structlog set-up shared by every process: key=value lines on stderr, level from VLLM_ACTORS_LOG_LEVEL."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def _stderr_logger(*args: object) -> structlog.PrintLogger:
    """A logger on whatever sys.stderr is now (test runners and embedding hosts replace it)."""
    return structlog.PrintLogger(file=sys.stderr)


def configure_logging(level: str | None = None) -> None:
    name = (level or os.environ.get("VLLM_ACTORS_LOG_LEVEL", "WARNING")).upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, name, logging.WARNING)),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
