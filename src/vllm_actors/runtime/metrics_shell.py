"""The metrics store's shell: everything around the pure ``MetricsStore`` that does I/O.

``run_metrics`` is the metrics actor process: it SUBscribes to the whole bus, records every batch,
and answers queries on a ROUTER. The helpers below are its I/O, also used by the in-process
engine: ``record_logged`` logs what the store noticed (gaps, stale batches, restarts, dropped
records), ``answer`` answers a query, writing the file of a ``DumpQuery`` into the dump directory
(the group's run directory) under a name it chooses: a query never names the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import msgspec
import structlog
import zmq

from vllm_actors.actors.metrics_store.dump import DumpContent
from vllm_actors.actors.metrics_store.notices import Notice
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.envs import envs
from vllm_actors.protocol.events import (
    ActorReady,
    ActorStarting,
    ActorStopped,
    EventBatch,
)
from vllm_actors.protocol.metrics import (
    DumpReply,
    ErrorReply,
    MetricsCodec,
    MetricsQuery,
    MetricsReply,
    SeenQuery,
)
from vllm_actors.runtime import signal_wake
from vllm_actors.runtime.process import READY_TIMEOUT, ActorSpec, report
from vllm_actors.runtime.security import GroupKeys, bind, connect
from vllm_actors.runtime.zmq_shell import EVENT_HWM, EventPublisher

log = structlog.get_logger(__name__)


# --------------------------------------------------------------------------- the store's I/O
def log_notices(notices: Iterable[Notice]) -> None:
    for notice in notices:
        getattr(log, notice.level)(notice.message, **dataclasses.asdict(notice))


def record_logged(store: MetricsStore, batch: EventBatch, topic: str | None = None) -> None:
    """Record one batch (``topic``: the bus topic it came under) and log what the store noticed."""
    notices = store.record(batch, topic=topic)
    if notices:
        log_notices(notices)


def write_dump(content: DumpContent, directory: Path) -> MetricsReply:
    """Write a dump's lines to a new file in ``directory`` (mode 0600, a name no other dump has:
    ``events-*.jsonl``); the asking side moves it away."""
    try:
        descriptor, path = tempfile.mkstemp(prefix="events-", suffix=".jsonl", dir=directory)
    except OSError as exc:
        return ErrorReply(message=f"cannot write a dump in {directory}: {exc}")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            for line in content.lines():
                handle.write(line)
                handle.write("\n")
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return ErrorReply(message=f"cannot write {path}: {exc}")
    log.info("event log dumped", path=path, num_events=content.num_events)
    return DumpReply(path=path, num_events=content.num_events)


def answer(store: MetricsStore, query: MetricsQuery, dump_dir: Path) -> MetricsReply:
    """The store's reply to one query, a dump written into ``dump_dir``; never raises: a query
    that fails gets an ``ErrorReply``."""
    try:
        reply = store.query(query)
        if isinstance(reply, DumpContent):
            return write_dump(reply, dump_dir)
        return reply
    except Exception as exc:  # a query must always get a reply
        log.exception("query failed", query=type(query).__name__)
        return ErrorReply(message=f"query failed: {type(exc).__name__}: {exc}")


def answer_frame(store: MetricsStore, codec: MetricsCodec, frame: bytes, actor_id: str, dump_dir: Path) -> bytes | None:
    """The reply frame to a query frame; None (logged) for a frame that is no query."""
    try:
        query = codec.decode_query(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        log.warning("frame dropped", actor=actor_id, why="undecodable query", error=str(error))
        return None
    return codec.encode(answer(store, query, dump_dir))


def events_seen(store: MetricsStore, actor_id: str) -> int:
    reply = store.query(SeenQuery(actor=actor_id))
    seen = reply.actors.get(actor_id)  # type: ignore[union-attr]
    return 0 if seen is None else seen.num_events


# Environment variables that raise (or lower) the event log's bounds, e.g. for a benchmark that
# wants the trace of a whole run: events retained, and their estimated bytes.
MAX_EVENTS_ENV = "VLLM_ACTORS_METRICS_MAX_EVENTS"
MAX_BYTES_ENV = "VLLM_ACTORS_METRICS_MAX_BYTES"


def store_bounds(max_events: int) -> dict[str, int]:
    """The store's event-log bounds: ``max_events`` (the spec's) and the default bytes, unless
    the environment names others."""
    bounds = {"max_events": max_events}
    for value, key in ((envs.VLLM_ACTORS_METRICS_MAX_EVENTS, "max_events"),
                       (envs.VLLM_ACTORS_METRICS_MAX_BYTES, "max_history_bytes")):
        if value is not None:
            bounds[key] = value
    return bounds


# --------------------------------------------------------------------------- the process
def run_metrics(spec: ActorSpec, context: zmq.Context, stop: threading.Event, keys: GroupKeys | None = None) -> None:
    """The metrics store: SUBscribes to the whole bus, answers queries on a ROUTER; dumps go to
    the run directory."""
    codec = MetricsCodec()
    dump_dir = Path(spec.run_dir)
    if not spec.run_dir or not dump_dir.is_dir():
        raise ValueError(f"the metrics store needs the group's run directory for its dumps, got {spec.run_dir!r}")

    store = MetricsStore(**store_bounds(spec.metrics_max_events))
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.RCVHWM, EVENT_HWM)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    connect(subscriber, spec.addresses.bus_out, keys)
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    bind(router, spec.addresses.metrics, keys)
    publisher = EventPublisher.for_actor(context, spec.addresses, spec.actor_id, keys)
    batch_decoder = msgspec.msgpack.Decoder(EventBatch)

    def receive_events() -> None:
        while True:
            try:
                frames = subscriber.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                batch = batch_decoder.decode(frames[-1])
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                log.warning("frame dropped", actor=spec.actor_id, why="undecodable event batch", error=str(error))
                continue
            record_logged(store, batch, frames[0].decode(errors="replace") if len(frames) == 2 else None)

    # Ready once our own events come back through the bus: the subscription is live.
    pid = os.getpid()
    deadline = time.monotonic() + READY_TIMEOUT
    while events_seen(store, spec.actor_id) == 0:
        if time.monotonic() > deadline:
            raise TimeoutError("the metrics store never received its own events through the bus")
        publisher.publish([ActorStarting(pid=pid, role=spec.role)])
        if subscriber.poll(100):
            receive_events()
    publisher.publish([ActorReady(pid=pid, role=spec.role)])
    report("ready", info={})

    poller = zmq.Poller()
    poller.register(subscriber, zmq.POLLIN)
    poller.register(router, zmq.POLLIN)
    signal_wake.watch(poller)
    while not stop.is_set():
        ready = dict(poller.poll(100))
        signal_wake.woke(ready)
        if subscriber in ready:
            receive_events()
        if router in ready:
            while True:
                try:
                    frames = router.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 2:
                    log.warning("frame dropped", actor=spec.actor_id, why="wrong frame count", frames=len(frames))
                    continue
                receive_events()  # answer with everything that has arrived
                reply = answer_frame(store, codec, frames[1], spec.actor_id, dump_dir)
                if reply is not None:
                    router.send_multipart([frames[0], reply])
    publisher.publish([ActorStopped(reason="signal")])
    for socket in (subscriber, router):
        socket.close()
    publisher.close()
