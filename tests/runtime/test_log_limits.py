"""Bounded logs: rate-limited per (level, event) and in all, with a line saying how many
were suppressed; errors on one line (tracebacks only at DEBUG, never with local variables); long
values cut. A flood of malformed frames at an actor shell costs a few lines, not one per frame."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import zmq

from tests.runtime.test_shell_errors import make_shell
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.protocol.messages import AddRequest
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runtime import log_setup
from vllm_actors.runtime.log_processors import MAX_VALUE_CHARS, SUPPRESSED_EVENT, RateLimiter
from vllm_actors.runtime.log_setup import configure_logging


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def stderr(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """What configure_logging's loggers write (pytest's capture swaps sys.stderr between phases)."""
    stream = io.StringIO()
    monkeypatch.setattr(log_setup, "_stderr_logger", lambda *args: structlog.PrintLogger(file=stream))
    yield stream
    monkeypatch.undo()
    configure_logging()


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    """configure_logging's rate limiters read this clock."""
    fake = FakeClock()

    def limiter(per_key: int = 10, total: int = 100) -> RateLimiter:
        return RateLimiter(per_key=per_key, total=total, clock=fake)

    monkeypatch.setattr(log_setup, "RateLimiter", limiter)
    return fake


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_flood_of_one_line_is_limited_then_counted(stderr: io.StringIO, clock: FakeClock) -> None:
    configure_logging("INFO", lines_per_second=10)
    log = structlog.get_logger("test")
    for index in range(1_000):
        log.warning("frame dropped", index=index)
    assert len(lines(stderr)) == 10
    clock.now += 0.5
    log.warning("frame dropped", index=1_000)  # still the same second: suppressed too
    assert len(lines(stderr)) == 10
    clock.now += 0.6
    log.info("something else")  # any later line brings the count out first
    summary, other = lines(stderr)[10:]
    assert SUPPRESSED_EVENT in summary and "suppressed=991" in summary and "like='frame dropped'" in summary
    assert "[warning" in summary and "something else" in other
    for index in range(20):  # a new second: ten more get through
        log.warning("frame dropped", index=index)
    assert sum("frame dropped" in line and SUPPRESSED_EVENT not in line for line in lines(stderr)) == 20


def test_many_different_lines_are_limited_in_all(stderr: io.StringIO, clock: FakeClock) -> None:
    configure_logging("INFO", lines_per_second=10)
    log = structlog.get_logger("test")
    for index in range(1_000):
        log.warning(f"request {index} went wrong")  # a new event each time: only the total limits
    assert len(lines(stderr)) == 100
    clock.now += 1.0
    log.warning("after")
    assert "suppressed=900" in lines(stderr)[100] and "like=(any)" in lines(stderr)[100]


def test_no_limit_when_asked(stderr: io.StringIO) -> None:
    configure_logging("INFO", lines_per_second=0)
    log = structlog.get_logger("test")
    for index in range(500):
        log.warning("frame dropped", index=index)
    assert len(lines(stderr)) == 500


def failing_query(secret_local: str) -> None:
    nested = {"where": secret_local}
    raise ValueError(f"bad query\nfor {nested['where'][:3]}")


@pytest.mark.parametrize("level", ["WARNING", "ERROR", "INFO"])
def test_errors_are_one_line_without_traceback_above_debug(stderr: io.StringIO, level: str) -> None:
    configure_logging(level)
    log = structlog.get_logger("test")
    try:
        failing_query("local-value-" + "v" * 100)
    except ValueError:
        log.exception("query failed", request_id="r-1")
    try:
        failing_query("local-value")
    except ValueError as error:
        log.error("actor failed", exc_info=error)
    output = lines(stderr)
    assert len(output) == 2, output
    assert "Traceback" not in stderr.getvalue() and "local-value-v" not in stderr.getvalue()
    assert "error='ValueError: bad query\\nfor loc'" in output[0] and "request_id=r-1" in output[0]
    assert f"where='test_log_limits.py:{failing_query.__code__.co_firstlineno + 2} in failing_query'" in output[0]
    assert "actor failed" in output[1] and "ValueError" in output[1]


def test_at_debug_the_traceback_is_plain(stderr: io.StringIO) -> None:
    configure_logging("DEBUG")
    try:
        failing_query("local-value-" + "v" * 100)
    except ValueError:
        structlog.get_logger("test").exception("query failed")
    output = stderr.getvalue()
    assert "Traceback" in output and "failing_query" in output
    assert "local-value-v" not in output  # no local variables


def test_long_values_and_multi_line_events_are_cut_to_one_line(stderr: io.StringIO) -> None:
    configure_logging("INFO")
    structlog.get_logger("test").warning("two\nlines", request_id="x" * 60_000, frames=[b"y" * 10_000])
    (line,) = lines(stderr)
    assert "two\\nlines" in line and len(line) < 3 * MAX_VALUE_CHARS
    assert f"(+{60_000 - MAX_VALUE_CHARS} chars)" in line


def test_malformed_frames_at_an_actor_shell_cost_a_few_lines(stderr: io.StringIO, clock: FakeClock,
                                                             tmp_path: Path) -> None:
    configure_logging("WARNING", lines_per_second=10)
    context = zmq.Context()
    shell = make_shell(context, tmp_path, KVCacheManager(num_blocks=8, block_size=4), {})
    try:
        add = AddRequest(request_id="r", prompt_token_ids=[1], params=SamplingParams(), eos_token_ids=[0])
        for _ in range(5_000):  # a message type the KV-cache manager does not take, from anyone
            shell.receive(b"intruder", add)
        assert shell.num_dropped == 5_000
        assert len(lines(stderr)) == 10
        clock.now += 1.0
        shell.receive(b"intruder", add)
        assert "suppressed=4990" in lines(stderr)[10]
    finally:
        shell.close()
        context.term()


def test_uvicorn_lines_are_bounded_and_one_line() -> None:
    """uvicorn logs through the standard library: a flood of one line is cut to the limit plus one
    count, and an exception loses its traceback (kept as error=) unless at DEBUG."""
    import logging

    from vllm_actors.runtime.stdlib_log_limits import StdlibLogLimit

    now = [0.0]
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("test.uvicorn.flood")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    logger.addFilter(StdlibLogLimit(per_key=5, clock=lambda: now[0]))
    for _ in range(1000):
        logger.warning("Invalid HTTP request received.")
    assert len(records) == 5
    now[0] = 1.5
    logger.warning("Invalid HTTP request received.")
    assert [r.getMessage() for r in records[5:]] == [
        "log lines suppressed like='Invalid HTTP request received.' suppressed=995 seconds=1.0",
        "Invalid HTTP request received."]
    try:
        raise ValueError("bad frame")
    except ValueError:
        logger.exception("Exception in ASGI application")
    assert records[-1].exc_info is None
    assert records[-1].getMessage() == "Exception in ASGI application error=ValueError: bad frame"
