"""Events are trusted only from their publisher: the bus checks each batch's topic against the
endpoint it came in on, the metrics store checks the batch against its topic and what a client
may publish. Unit tests of both checks, the bus's own loop (forwarding, subscriptions, a stale
ipc socket file), then forgeries against a real group on the tiny model."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.support.lifecycle import settled_metrics
from vllm_actors import LLM, SamplingParams
from vllm_actors.actors.metrics_store.ingest import client_may_publish
from vllm_actors.actors.metrics_store.notices import Untrusted
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.protocol.events import ActorFailed as ActorFailedEvent
from vllm_actors.protocol.events import (
    ActorRestarted,
    ActorStopped,
    Arrived,
    Event,
    EventBatch,
    Finished,
    GroupFailed,
    Heartbeat,
    KvPool,
    PipelineReset,
    StepFinished,
    Tokens,
)
from vllm_actors.protocol.metrics import SeenQuery, SummaryQuery, SummaryReply
from vllm_actors.protocol.names import is_engine_actor
from vllm_actors.runtime.bus import Bus, topic_allowed
from vllm_actors.runtime.run_dir import make_addresses, read_group_info

FORGED_POOL = KvPool(num_blocks=1000, num_free=10, num_cached=0, num_cached_idle=0, num_in_use=990)


def batch(actor: str, seq: int, *events: Event) -> EventBatch:
    return EventBatch(actor=actor, first_seq=seq, mono=time.monotonic(), wall=time.time(), events=list(events))


def summary(store: MetricsStore) -> SummaryReply:
    reply = store.query(SummaryQuery())
    assert isinstance(reply, SummaryReply)
    return reply


# --------------------------------------------------------------------------- the rules
def test_engine_ids_and_the_bus_topic_rule() -> None:
    for actor in ("scheduler", "kv_cache_manager", "worker-0", "worker-7", "metrics", "bus", "supervisor"):
        assert is_engine_actor(actor)
        assert topic_allowed(actor, actor.encode())
        assert not topic_allowed(None, actor.encode())  # never under an engine id on the clients' endpoint
    for client in ("frontend-client-1-ab", "probe-12-0", "frontend"):
        assert not is_engine_actor(client)
        assert topic_allowed(None, client.encode())
    assert not topic_allowed("worker-0", b"kv_cache_manager")  # an actor's endpoint: its own id only
    assert not topic_allowed("worker-0", b"worker-0x")
    assert not topic_allowed(None, b"") and not topic_allowed(None, b"\xff\xfe")


def test_group_addresses_give_every_engine_actor_its_own_endpoint(tmp_path: Path) -> None:
    addresses = make_addresses(tmp_path, num_workers=2)
    owned = addresses.bus_in_actors
    assert set(owned) == {"metrics", "worker-0", "worker-1", "kv_cache_manager", "scheduler", "supervisor"}
    assert len(set(owned.values()) | {addresses.bus_in}) == len(owned) + 1
    assert addresses.publish_address("worker-1") == owned["worker-1"]
    assert addresses.publish_address("frontend-x") == addresses.bus_in


def test_group_json_leaves_out_the_actors_endpoints(tmp_path: Path) -> None:
    from vllm_actors.runtime.run_dir import GroupInfo, write_group_info

    info = GroupInfo(pid=1, run_dir=str(tmp_path), model="m", addresses=make_addresses(tmp_path, 1))
    write_group_info(info)
    written = read_group_info(tmp_path)
    assert written.addresses.bus_in_actors == {} and written.addresses.bus_in == info.addresses.bus_in


# --------------------------------------------------------------------------- the store
def test_store_drops_a_batch_naming_another_actor_than_its_topic() -> None:
    store = MetricsStore()
    store.record(batch("kv_cache_manager", 0, KvPool(num_blocks=20, num_free=20, num_cached=0, num_cached_idle=0,
                                                     num_in_use=0)), topic="kv_cache_manager")
    before = summary(store)
    notices = store.record(batch("kv_cache_manager", 1, FORGED_POOL), topic="frontend-evil")
    assert notices == [Untrusted(publisher="frontend-evil", claimed="kv_cache_manager",
                                 why="batch names another actor than its topic", count=1)]
    after = summary(store)
    assert (after.kv_blocks_in_use, after.kv_blocks_total, after.rejected_batches) == (0, 20, 1)
    assert after.actors["kv_cache_manager"] == before.actors["kv_cache_manager"]  # not even its sequence moved
    assert "frontend-evil" not in after.actors


def test_store_applies_only_client_events_from_clients() -> None:
    store = MetricsStore()
    client = "frontend-client-1-ab"
    store.record(batch(client, 0, Arrived(request_id="r", num_prompt_tokens=3, max_tokens=4)), topic=client)
    forged = [FORGED_POOL, Tokens(step_id=1, request_ids=["r"], num_output_tokens=[9]),
              StepFinished(step_id=1, num_seqs=1, num_tokens=1, num_sampled=1, execute_ms=1.0),
              Finished(request_id="r", reason="length", num_prompt_tokens=3, num_output_tokens=4)]
    notices = store.record(batch(client, 1, *forged, Heartbeat(pid=5)), topic=client)
    assert len(notices) == len(forged) and all(isinstance(notice, Untrusted) for notice in notices)
    reply = summary(store)
    assert (reply.kv_blocks_total, reply.generation_tokens, reply.steps, reply.requests_finished) == (0, 0, 0, 0)
    seen = reply.actors[client]
    assert (seen.rejected_events, seen.num_events, seen.last_seq, seen.gaps) == (len(forged), 2, len(forged) + 1, 0)
    assert seen.pid == 5  # its heartbeat counted
    assert reply.rejected_events == len(forged)
    # a stop string ends a request at the frontend: a client event
    store.record(batch(client, 6, Finished(request_id="r", reason="stop", num_prompt_tokens=3, num_output_tokens=2)),
                 topic=client)
    assert summary(store).finished_by_reason == {"stop": 1}
    assert client_may_publish(Finished(request_id="r", reason="error", num_prompt_tokens=1, num_output_tokens=0))


def test_repeated_rejections_are_noticed_sparingly() -> None:
    store = MetricsStore()
    counts = [notice.count for seq in range(150)
              for notice in store.record(batch("worker-0", seq, Heartbeat(pid=1)), topic="probe-1")]
    assert counts == [1, 10, 100]
    assert summary(store).rejected_batches == 150


def test_supervision_events_are_counted() -> None:
    store = MetricsStore()
    store.record(batch("supervisor", 0,
                       ActorFailedEvent(actor="worker-0", how="exited", detail="SIGKILL"),
                       ActorRestarted(actor="worker-0", pid=9, attempt=1, seconds=2.5),
                       ActorFailedEvent(actor="scheduler", how="hung", detail="silent 5 s"),
                       ActorRestarted(actor="scheduler", pid=10, attempt=1, seconds=1.5)), topic="supervisor")
    store.record(batch("scheduler", 0, PipelineReset(reason="worker-0 restarted", num_preempted=2)), topic="scheduler")
    reply = summary(store)
    assert reply.actor_failures == {"worker-0": 1, "scheduler": 1}
    assert reply.actor_restarts == {"worker-0": 1, "scheduler": 1}
    assert reply.restart_seconds.count == 2 and reply.restart_seconds.mean == pytest.approx(2.0)
    assert reply.pipeline_resets == 1 and reply.group_failed is None
    store.record(batch("supervisor", 4, GroupFailed(reason="restart budget spent")), topic="supervisor")
    assert summary(store).group_failed == "restart budget spent"
    # a client cannot claim a restart
    store.record(batch("frontend-x", 0, ActorRestarted(actor="kv_cache_manager", pid=1, attempt=1, seconds=0.1)),
                 topic="frontend-x")
    assert "kv_cache_manager" not in summary(store).actor_restarts


# --------------------------------------------------------------------------- the bus loop
@pytest.fixture()
def short_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bus", dir="/tmp"))  # ipc paths are limited to ~100 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


class RunningBus:
    def __init__(self, directory: Path) -> None:
        self.context = zmq.Context()
        self.clients = f"ipc://{directory}/in"
        self.owned = {"worker-0": f"ipc://{directory}/in_w0", "scheduler": f"ipc://{directory}/in_s"}
        self.out = f"ipc://{directory}/out"
        self.bus = Bus(self.context, self.clients, self.owned, self.out)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.bus.run, args=(self.stop,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.bus.close()
        self.context.term()


def _socket(kind: int, address: str, topic: bytes | None = None) -> zmq.Socket:
    socket = zmq.Context.instance().socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    if topic is not None:
        socket.setsockopt(zmq.SUBSCRIBE, topic)
    socket.connect(address)
    return socket


def _published_until_received(publisher: zmq.Socket, subscriber: zmq.Socket, frames: list[bytes]) -> list[bytes]:
    """Publish until the subscriber gets something (the slow joiner); what it got first.

    The copies sent before the first one arrived may still be on their way; a marker sent after
    them arrives after them (one connection keeps its order), so reading up to the marker drains
    them and the next check sees only what it sends (CI once got a stray worker copy here).
    """
    for _ in range(500):
        publisher.send_multipart(frames)
        if subscriber.poll(20):
            got = subscriber.recv_multipart()
            marker = [frames[0], b"drained"]
            publisher.send_multipart(marker)
            while subscriber.recv_multipart() != marker:
                pass
            return got
    raise AssertionError("nothing came through the bus")


def test_bus_forwards_owned_topics_drops_forgeries_and_forwards_subscriptions(short_dir: Path) -> None:
    running = RunningBus(short_dir)
    try:
        everything = _socket(zmq.SUB, running.out, b"")
        only_scheduler = _socket(zmq.SUB, running.out, b"scheduler")
        worker = _socket(zmq.PUB, running.owned["worker-0"])
        client = _socket(zmq.PUB, running.clients)
        assert _published_until_received(worker, everything, [b"worker-0", b"w"]) == [b"worker-0", b"w"]
        assert _published_until_received(client, everything, [b"probe-1", b"p"])[0] == b"probe-1"
        # forgeries, each followed by a good batch on the same connection: once that arrived, the
        # forgery was handled before it
        forged_before = running.bus.drops.total
        for publisher, forged, good in ((worker, b"scheduler", b"worker-0"), (client, b"worker-0", b"probe-1"),
                                        (client, b"supervisor", b"probe-1")):
            publisher.send_multipart([forged, b"forged"])
            publisher.send_multipart([good, b"good"])
            while (frames := everything.recv_multipart()) != [good, b"good"]:
                assert frames[1] != b"forged", frames
        worker.send_multipart([b"worker-0", b"a", b"third frame"])
        worker.send_multipart([b"worker-0", b"good"])
        assert everything.recv_multipart() == [b"worker-0", b"good"]
        assert running.bus.drops.total == forged_before + 4
        assert running.bus.drops.by_source[("clients", "worker-0")] == 1
        # subscriptions reach the publishers: the scheduler-only subscriber gets only its topic
        scheduler = _socket(zmq.PUB, running.owned["scheduler"])
        assert _published_until_received(scheduler, only_scheduler, [b"scheduler", b"s"]) == [b"scheduler", b"s"]
        worker.send_multipart([b"worker-0", b"not for it"])
        scheduler.send_multipart([b"scheduler", b"s2"])
        while (frames := only_scheduler.recv_multipart()) == [b"scheduler", b"s"]:
            pass
        assert frames == [b"scheduler", b"s2"]
        for socket in (everything, only_scheduler, worker, client, scheduler):
            socket.close()
    finally:
        running.close()


def test_a_restarted_bus_rebinds_over_a_stale_ipc_socket_file(short_dir: Path) -> None:
    path = short_dir / "in_w0"
    # a bus killed without closing its sockets leaves the socket file behind
    code = ("import os, sys, zmq; s = zmq.Context().socket(zmq.XSUB); s.bind(sys.argv[1]); "
            "print('bound', flush=True); os.kill(os.getpid(), 9)")
    subprocess.run([sys.executable, "-c", code, f"ipc://{path}"], capture_output=True, timeout=60)
    assert path.is_socket()
    running = RunningBus(short_dir)
    try:
        subscriber = _socket(zmq.SUB, running.out, b"")
        worker = _socket(zmq.PUB, running.owned["worker-0"])
        assert _published_until_received(worker, subscriber, [b"worker-0", b"w"]) == [b"worker-0", b"w"]
        subscriber.close()
        worker.close()
    finally:
        running.close()


# --------------------------------------------------------------------------- a real group
@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path) -> Iterator[LLM]:
    with LLM(str(tiny_qwen3), dtype="float32", num_gpu_blocks_override=20, max_num_batched_tokens=48) as engine:
        yield engine


def _gauges(reply: SummaryReply) -> tuple[object, ...]:
    """What a forged KV_POOL, STOPPED or TOKENS would move; the worker's step counters are left
    out: its last STEP_FINISHED (the step that drops a finished request) may reach the store after
    the client got the request's last token, and after any snapshot taken then."""
    return (reply.kv_blocks_in_use, reply.kv_blocks_total, reply.kv_usage, reply.generation_tokens,
            reply.requests_finished, reply.actors["worker-0"].state, reply.actors["kv_cache_manager"].state)


def _bus_logged(llm: LLM, topic: str, endpoint: str) -> bool:
    log = (llm.group.log_dir / "bus.log").read_text(errors="replace")
    return any("event batch dropped" in line and f"topic={topic}" in line and f"endpoint={endpoint}" in line
               for line in log.splitlines())


_probe_numbers = itertools.count()


def test_forged_events_never_reach_the_store_and_the_group_keeps_serving(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reference = llm.generate("before forgery", params, use_tqdm=False)[0].outputs[0].token_ids
    query = llm.engine.query_metrics
    # The store hears each actor on its own pipe, after the client heard the scheduler: wait for the
    # group's first request to end (the scheduler's FINISHED), its blocks to be freed (the KV-cache
    # manager's KV_POOL) and a step per token (the worker's STEP_FINISHED, after its READY).
    def first_request_recorded(m: SummaryReply) -> bool:
        return (m.requests_finished, m.kv_blocks_in_use) == (1, 0) and m.kv_blocks_total > 0 \
            and m.steps >= params.max_tokens

    before = settled_metrics(llm, first_request_recorded)
    assert first_request_recorded(before), before
    addresses = llm.group.addresses
    encoder = msgspec.msgpack.Encoder()
    forged_events: list[Event] = [FORGED_POOL, ActorStopped(reason="forged")]

    def forged(topic: str, actor: str = "worker-0") -> list[bytes]:
        return [topic.encode(), encoder.encode(batch(actor, 10_000, *forged_events))]

    # 1. Under "worker-0" on the clients' endpoint, 2. on the worker's own endpoint under another
    # actor's id: both dropped by the bus (its log says so once it saw them).
    for address, topic, endpoint in ((addresses.bus_in, "worker-0", "clients"),
                                     (addresses.bus_in_actors["worker-0"], "kv_cache_manager", "worker-0")):
        publisher = _socket(zmq.PUB, address)
        deadline = time.monotonic() + 60
        while not _bus_logged(llm, topic, endpoint):
            assert time.monotonic() < deadline, f"the bus never logged dropping {topic} from {endpoint}"
            publisher.send_multipart(forged(topic))
            time.sleep(0.05)
        publisher.close()
    # 3. A client's topic on a batch naming worker-0, 4. engine events under a client's own id:
    # through the bus, not applied by the store. Sent again until the store has counted both: the
    # first sends of a new PUB connection may be dropped (the slow joiner), and the second of a
    # pair can pass where the first did not (CI at a35f64e: the probe seen, the forgery lost).
    engine_events = [FORGED_POOL, StepFinished(step_id=1, num_seqs=1, num_tokens=1, num_sampled=1, execute_ms=1.0)]
    publisher = _socket(zmq.PUB, addresses.bus_in)
    probe = f"probe-{os.getpid()}-trust-{next(_probe_numbers)}"
    deadline = time.monotonic() + 60
    for seq in itertools.count(1, len(engine_events) + 1):  # one batch after the other: no overlap
        publisher.send_multipart(forged(probe))
        publisher.send_multipart([probe.encode(), encoder.encode(batch(probe, seq, *engine_events, Heartbeat(pid=1)))])
        after = query(SummaryQuery())
        assert isinstance(after, SummaryReply)
        seen = after.actors.get(probe)
        if after.rejected_batches >= 1 and seen is not None and seen.rejected_events >= len(engine_events):
            break
        assert time.monotonic() < deadline, "the metrics store never counted the forgeries as rejected"
        time.sleep(0.02)
    publisher.close()

    assert _gauges(after) == _gauges(before)
    worker = after.actors["worker-0"]
    assert worker.last_seq < 10_000 and (worker.gaps, worker.stale_batches) == (0, 0), worker  # no forged sequence
    assert after.rejected_batches >= 1 and after.rejected_events >= len(engine_events)
    # each of the probe's batches applied its heartbeat only: its KV_POOL and STEP_FINISHED never counted
    seen = after.actors[probe]
    assert seen.num_events >= 1 and seen.rejected_events == len(engine_events) * seen.num_events, seen
    assert all(llm.group.alive().values()), llm.group.alive()
    assert llm.generate("before forgery", params, use_tqdm=False)[0].outputs[0].token_ids == reference
    # The store still counts the worker's steps: at least one per token of the new request (a
    # forged worker sequence would have the real one dropped as stale). Waited for, as above.
    served = settled_metrics(llm, lambda m: m.requests_finished == 2 and m.steps >= before.steps + params.max_tokens)
    assert served.requests_finished == 2 and served.steps >= before.steps + params.max_tokens, (before, served)
    assert served.kv_blocks_total == before.kv_blocks_total and served.actors["worker-0"].state == "READY"


def test_every_engine_actor_published_on_its_own_endpoint(llm: LLM) -> None:
    """The group works at all only if it does (the bus drops engine ids on the clients' endpoint);
    the store saw each engine actor from sequence 0 (no gap: it started before them)."""
    reply = llm.engine.query_metrics(SeenQuery())
    for actor in ("metrics", "worker-0", "kv_cache_manager", "scheduler"):
        seen = reply.actors[actor]  # type: ignore[union-attr]
        assert seen.state == "READY" and seen.gaps == 0 and seen.rejected_events == 0, (actor, seen)


def test_a_restarted_store_records_what_it_never_saw_as_a_gap() -> None:
    store = MetricsStore()  # a fresh incarnation: the actors have been publishing for a while
    store.record(batch("scheduler", 40, Tokens(step_id=9, request_ids=["r"], num_output_tokens=[3])),
                 topic="scheduler")
    store.record(batch("worker-0", 7, Heartbeat(pid=3)), topic="worker-0")  # a handshake: the slow joiner
    actors = summary(store).actors
    assert (actors["scheduler"].gaps, actors["scheduler"].missed) == (1, 40)
    assert (actors["worker-0"].gaps, actors["worker-0"].missed) == (0, 0)
