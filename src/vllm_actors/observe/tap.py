"""Event taps and stats: attach to a running group from outside and watch or query it.

A tap is one more SUB socket on the bus's XPUB side. It never sends anything into the group, and
the bus drops (rather than waits) for a subscriber that falls behind, so attaching, detaching or a
slow terminal never disturbs serving; what a tap misses shows as a gap line.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import msgspec
import structlog
import zmq

from vllm_actors.observe.tap_format import GapTracker, TapFilter, render_batch
from vllm_actors.protocol.events import EventBatch
from vllm_actors.protocol.metrics import (
    DumpQuery,
    DumpReply,
    MetricsCodec,
    MetricsQuery,
    MetricsReply,
    SummaryQuery,
    TimelineQuery,
)
from vllm_actors.runtime.run_dir import GroupAddresses, GroupInfo, find_running_group, read_group_info
from vllm_actors.runtime.security import GroupKeys, connect, is_tcp
from vllm_actors.runtime.zmq_shell import EVENT_HWM

log = structlog.get_logger(__name__)


def locate_group(run_dir: str | None) -> GroupInfo:
    return read_group_info(run_dir) if run_dir else find_running_group()


def group_endpoint(run_dir: str | None, address: str | None,
                   pick: Callable[[GroupAddresses], str]) -> tuple[str, GroupKeys | None]:
    """Where to attach: ``address``, or ``pick`` of the group's addresses; for a TCP endpoint, with
    the group's CURVE keys, read from its run directory (``run_dir``, else the newest running group)."""
    if address is not None and not is_tcp(address):
        return address, None
    info = locate_group(run_dir)
    endpoint = address or pick(info.addresses)
    return endpoint, GroupKeys.load(info.run_dir) if is_tcp(endpoint) else None


def bus_topics(tap_filter: TapFilter) -> list[bytes]:
    """Topic prefixes to subscribe to: the bus filters by actor id when the names are exact."""
    actors = tap_filter.actors
    if not actors or any(set(name) & set("*?[") for name in actors):
        return [b""]
    return sorted(name.encode() for name in actors)


def run_tap(
    address: str,
    tap_filter: TapFilter,
    out: TextIO,
    *,
    as_json: bool = False,
    color: bool = False,
    max_events: int | None = None,
    duration: float | None = None,
    stop: Callable[[], bool] = lambda: False,
    keys: GroupKeys | None = None,
) -> int:
    """Print the live stream until interrupted (or ``max_events`` lines / ``duration`` seconds)."""
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, EVENT_HWM)
    socket.setsockopt(zmq.LINGER, 0)
    for topic in bus_topics(tap_filter):
        socket.setsockopt(zmq.SUBSCRIBE, topic)
    connect(socket, address, keys)
    decoder = msgspec.msgpack.Decoder(EventBatch)
    gaps = GapTracker()
    printed = 0
    deadline = None if duration is None else time.monotonic() + duration
    try:
        # announced inside the try: a Ctrl-C right after the announcement still ends cleanly
        sys.stderr.write(f"# tap attached to {address}\n")
        sys.stderr.flush()
        while not stop():
            if deadline is not None and time.monotonic() > deadline:
                break
            if not socket.poll(100):
                continue
            frames = socket.recv_multipart()
            try:
                batch = decoder.decode(frames[-1])
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                log.warning("frame dropped", actor="tap", why="undecodable event batch", error=str(error))
                continue
            for line in render_batch(batch, tap_filter, gaps, color, as_json):
                out.write(line + "\n")
                printed += 1
                if max_events is not None and printed >= max_events:
                    out.flush()
                    return printed
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        socket.close()
        context.term()
    return printed


def query_metrics(address: str, query: MetricsQuery, timeout_ms: int = 5000,
                  keys: GroupKeys | None = None) -> MetricsReply:
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    connect(socket, address, keys)
    codec = MetricsCodec()
    try:
        socket.send(codec.encode(query))
        if not socket.poll(timeout_ms):
            raise TimeoutError(f"no answer from the metrics store at {address}")
        return codec.decode_reply(socket.recv())
    finally:
        socket.close()
        context.term()


def stats_query(timeline: str | None, dump: str | None, replica: int | None = None) -> MetricsQuery:
    if timeline is not None:
        return TimelineQuery(request_id=timeline)
    if dump is not None:
        return DumpQuery()  # the store names the file in its run directory; ``save_dump`` moves it
    return SummaryQuery(replica=replica)


def save_dump(reply: DumpReply, destination: str | Path) -> DumpReply:
    """Move the file the store wrote (in the group's run directory) to ``destination``."""
    target = Path(destination).absolute()
    shutil.move(reply.path, target)
    return DumpReply(path=str(target), num_events=reply.num_events)

