"""The shell around ``observe.trace``: a running group's event log (or a dump of it) into a Chrome
trace file of bounded size, for ``vllm-actors stats --trace`` and the benchmarks' ``--trace``.

Size: a trace is written in full detail when it fits ``max_bytes`` (as written: compressed for
.gz); else with each request's consecutive decode steps merged into one slice; else with every
2nd, 4th, 8th request's thread kept (the actor threads, steps and counters keep every event); else
from the newest half, quarter, ... of the log alone. What was done is in the file's
``otherData`` and in the returned ``TraceFile``. A name ending in ``.gz`` is written gzipped
(ui.perfetto.dev opens both)."""

from __future__ import annotations

import gzip
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

from vllm_actors.observe.trace import TraceOptions, TraceRow, chrome_trace
from vllm_actors.protocol.metrics import DumpQuery, DumpReply, MetricsQuery, MetricsReply, parse_event_json_line
from vllm_actors.runtime.metrics_shell import MAX_BYTES_ENV, MAX_EVENTS_ENV
from vllm_actors.runtime.run_dir import GroupInfo, pid_alive, read_group_info, runs_root

# The most a device call brings back per file is 16 MiB; the traces kept in benchmarks/measured
# stay well under it.
DEFAULT_MAX_TRACE_BYTES = 8 << 20
MAX_STRIDE = 8  # past every 8th request, the oldest events go instead
TRACED_MAX_EVENTS = 200_000  # what a benchmark's traced group retains


@dataclass(frozen=True)
class TraceFile:
    path: str
    num_bytes: int  # as written (compressed for .gz)
    num_events: int  # log events read
    num_trace_events: int
    options: TraceOptions
    num_left_out: int = 0  # the oldest log events left out to fit the bound


def read_dump(path: str | Path) -> list[TraceRow]:
    """The rows of a dump (``vllm-actors stats --dump``: JSON lines)."""
    with Path(path).open("rb") as handle:
        return [parse_event_json_line(line) for line in handle if line.strip()]


def _attempts(num_rows: int) -> Iterable[tuple[TraceOptions, int]]:
    """(options, how many of the oldest rows to leave out), from the most detail to the least."""
    yield TraceOptions(), 0
    for stride in (1, 2, 4, MAX_STRIDE):
        yield TraceOptions(detail="runs", request_stride=stride), 0
    kept = num_rows // 2
    while kept >= 1:
        yield TraceOptions(detail="runs", request_stride=MAX_STRIDE), num_rows - kept
        kept //= 2


def fitted_trace(rows: Sequence[TraceRow], max_bytes: int | None, compress: bool = False
                 ) -> tuple[bytes, dict[str, object]]:
    """The trace's JSON (gzipped with ``compress``), in the most detail that fits ``max_bytes``
    (None or 0: full detail)."""
    encoded = b""
    trace: dict[str, object] = {}
    for options, left_out in _attempts(len(rows)):
        trace = chrome_trace(rows[left_out:], options)
        other = trace["otherData"]
        assert isinstance(other, dict)
        other["log_events_left_out"] = left_out
        encoded = msgspec.json.encode(trace)
        if compress:
            encoded = gzip.compress(encoded, compresslevel=6)
        if not max_bytes or len(encoded) <= max_bytes:
            break
    return encoded, trace


def write_trace(rows: Sequence[TraceRow], path: str | Path, max_bytes: int | None = DEFAULT_MAX_TRACE_BYTES
                ) -> TraceFile:
    target = Path(path)
    encoded, trace = fitted_trace(rows, max_bytes, compress=target.name.endswith(".gz"))
    target.parent.mkdir(parents=True, exist_ok=True)
    temporary = target.with_name(target.name + ".tmp")
    temporary.write_bytes(encoded)
    temporary.replace(target)
    other = trace["otherData"]
    assert isinstance(other, dict)
    events = trace["traceEvents"]
    assert isinstance(events, list)
    return TraceFile(path=str(target), num_bytes=target.stat().st_size, num_events=len(rows),
                     num_trace_events=len(events),
                     options=TraceOptions(detail=str(other["detail"]), request_stride=int(other["request_stride"])),
                     num_left_out=int(other["log_events_left_out"]))


def trace_from_store(query: Callable[[MetricsQuery], MetricsReply], path: str | Path,
                     max_bytes: int | None = DEFAULT_MAX_TRACE_BYTES) -> TraceFile:
    """Ask the metrics store (through ``query``) for a dump of its event log, on this host, and
    write it as a trace; the dump file is removed."""
    reply = query(DumpQuery())
    if not isinstance(reply, DumpReply):
        raise RuntimeError(f"the metrics store could not dump its event log: {reply!r}")
    try:
        rows = read_dump(reply.path)
    finally:
        Path(reply.path).unlink(missing_ok=True)
    return write_trace(rows, path, max_bytes)


def group_of(pid: int) -> GroupInfo | None:
    """The running group whose supervisor is ``pid`` (``vllm-actors serve``'s process), if any."""
    for group_file in runs_root().glob("*/group.json"):
        try:
            info = read_group_info(group_file.parent)
        except (OSError, msgspec.DecodeError):
            continue
        if info.pid == pid and pid_alive(pid):
            return info
    return None


def max_trace_bytes(megabytes: float) -> int | None:
    """A ``--trace-max-mb`` value in bytes (0: no bound)."""
    return int(megabytes * (1 << 20)) or None



def add_trace_arguments(group: Any, what: str) -> None:
    """A benchmark's ``--trace PATH``, ``--trace-max-mb`` and ``--trace-max-events``."""
    group.add_argument("--trace", metavar="PATH", default=None,
                       help=f"{what} as a Chrome trace (ui.perfetto.dev; PATH ending in .gz: gzipped)")
    group.add_argument("--trace-max-mb", type=float, default=DEFAULT_MAX_TRACE_BYTES / (1 << 20),
                       help="size bound of a trace: merged decode slices, then every 2nd, 4th, 8th request, then "
                            "the newest part of the log (0: none)")
    group.add_argument("--trace-max-events", type=int, default=TRACED_MAX_EVENTS,
                       help=f"events a traced group's metrics store retains (default {TRACED_MAX_EVENTS:,}: a "
                            "whole run of a minute; the store's own default is 50,000)")


def retention_env(max_events: int) -> dict[str, str]:
    """The environment that makes a group's metrics store keep ``max_events`` events (about 1 KiB
    each at most), read by the store at its start."""
    return {MAX_EVENTS_ENV: str(max_events), MAX_BYTES_ENV: str(max(max_events, 1) * 1024)}


def trace_record(written: TraceFile) -> dict[str, Any]:
    """What a benchmark's results say about the trace it wrote."""
    record = asdict(written)
    record["options"] = asdict(written.options)
    return record
