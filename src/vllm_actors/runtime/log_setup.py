"""structlog set-up shared by every process: key=value lines on stderr, level from VLLM_ACTORS_LOG_LEVEL.

Bounded (``log_processors``): at most ``VLLM_ACTORS_LOG_RATE`` lines a second per (level, event)
(default 10; 0: no limit) and ten times that in all, then one "log lines suppressed" line; an
error is one line (its traceback, plain, only at DEBUG); every value cut at 1,000 characters.
"""

from __future__ import annotations

import logging
import sys

import structlog

from vllm_actors.envs import envs
from vllm_actors.runtime.log_processors import OneLineErrors, RateLimiter, cap_values


def _stderr_logger(*args: object) -> structlog.PrintLogger:
    """A logger on whatever sys.stderr is now (test runners and embedding hosts replace it)."""
    return structlog.PrintLogger(file=sys.stderr)


def log_rate(value: int | None = None) -> int:
    return envs.VLLM_ACTORS_LOG_RATE if value is None else value


def configure_logging(level: str | None = None, lines_per_second: int | None = None) -> None:
    name = (level or envs.VLLM_ACTORS_LOG_LEVEL).upper()
    numeric = getattr(logging, name, logging.WARNING)
    rate = log_rate(lines_per_second)
    limit: list[structlog.typing.Processor] = [RateLimiter(per_key=rate, total=10 * rate)] if rate > 0 else []
    structlog.configure(
        processors=[
            *limit,
            structlog.contextvars.merge_contextvars,
            OneLineErrors(debug=numeric <= logging.DEBUG),
            cap_values,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
