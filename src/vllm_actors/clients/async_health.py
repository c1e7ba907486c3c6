"""How the asyncio client reaches the metrics store and judges the group's health.

``MetricsChannel``: one DEALER to the store, one query at a time; a query that times out closes
the socket and opens a fresh one (a late reply would otherwise answer the next query).
``HealthProbe``: what ``AsyncEngineClient.health`` needs beyond the supervisor's own view. The step
pipeline (scheduler, KV-cache manager, workers) down or restarting makes the group "unavailable";
the bus or the metrics store down, or an event of this client not reaching the store in time,
"degraded" (serving goes on); a group given up, "failed". With an owned group the actors' states
are the supervisor's (``ProcessGroup.state()``), never taken from events on the bus; an attached
client combines the supervisor's events with the metrics store's view of each actor.
``AsyncQueries``: the client's calls over both (metrics queries, ``health``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from vllm_actors.clients.core import expect_reply
from vllm_actors.clients.supervision import READY, Health, SupervisionView, classify, group_states
from vllm_actors.protocol.events import EventBatch, Heartbeat
from vllm_actors.protocol.metrics import (
    MetricsCodec,
    MetricsQuery,
    MetricsReply,
    SeenQuery,
    SeenReply,
    SummaryQuery,
    SummaryReply,
    TimelineQuery,
    TimelineReply,
)
from vllm_actors.protocol.names import (
    CONTROLLER,
    KV_CACHE_MANAGER,
    SCHEDULER,
    replica_actor,
    split_replica,
    worker_id,
)
from vllm_actors.runtime.run_dir import GroupInfo, pid_alive
from vllm_actors.runtime.security import GroupKeys, connect
from vllm_actors.runtime.zmq_shell import EventPublisher

if TYPE_CHECKING:
    from vllm_actors.runtime.supervisor import ProcessGroup


class MetricsChannel:
    def __init__(self, context: zmq.asyncio.Context, address: str, keys: GroupKeys | None = None) -> None:
        self._context = context
        self._address = address
        self._keys = keys
        self._codec = MetricsCodec()
        self._lock = asyncio.Lock()
        self._socket = self._connect()

    def _connect(self) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        connect(socket, self._address, self._keys)
        return socket

    async def query(self, query: MetricsQuery, timeout: float = 5.0) -> MetricsReply:
        """One query; raises TimeoutError when the store does not answer."""
        async with self._lock:
            try:
                await self._socket.send(self._codec.encode(query))
                payload = await asyncio.wait_for(self._socket.recv(), timeout)
            except asyncio.TimeoutError:
                self._reset()
                raise TimeoutError("the metrics store did not answer") from None
            except BaseException:
                # Cancelled (a caller's own timeout, a task cancelled) between the query and its
                # reply: that reply would still come, and answer the next query with old numbers
                # (a scrape showing the state as of an earlier scrape). A fresh socket never gets it.
                self._reset()
                raise
            return self._codec.decode_reply(payload)

    def _reset(self) -> None:
        self._socket.close(linger=0)
        self._socket = self._connect()

    def close(self) -> None:
        self._socket.close(linger=0)


async def bus_round_trip(publisher: EventPublisher, metrics: MetricsChannel, actor_id: str, timeout: float) -> bool:
    """Publish a heartbeat and wait until the metrics store has seen it (bus and store alive)."""
    publisher.publish([Heartbeat(pid=os.getpid())])
    wanted = publisher.stamper.next_seq - 1
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        reply = await metrics.query(SeenQuery(actor=actor_id), timeout=remaining)
        seen = reply.actors.get(actor_id) if isinstance(reply, SeenReply) else None
        if seen is not None and seen.last_seq >= wanted:
            return True
        await asyncio.sleep(0.01)


class HealthProbe:
    def __init__(self, info: GroupInfo, publisher: EventPublisher, metrics: MetricsChannel, actor_id: str) -> None:
        self.info = info
        self.publisher = publisher
        self.metrics = metrics
        self.actor_id = actor_id

    async def wait_seen(self, timeout: float) -> None:
        """Wait until the metrics store sees this client's events (PUB/SUB drops what is published
        before the subscription is in place); TimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await bus_round_trip(self.publisher, self.metrics, self.actor_id, timeout=1.0):
                    return
            except TimeoutError:  # a store slow to answer (a loaded machine): ask again until the deadline
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the metrics store did not see {self.actor_id}'s events within {timeout:.0f} s")

    async def states(self, group: object | None, down: dict[str, str], timeout: float) -> dict[str, str]:
        """Each actor's state: an owned group's from its supervisor (with the store's reach while
        the bus and the store are up), an attached client's from the bus and the store."""
        if group is None:
            return await self.attached_states(down, timeout)
        states = group_states(group)
        if states.get("bus", READY) == READY and states.get("metrics", READY) == READY:
            states.update(await self.store_reachable(timeout))
        return states

    async def store_reachable(self, timeout: float) -> dict[str, str]:
        """An event of this client must reach the metrics store through the bus within ``timeout``."""
        try:
            if not await bus_round_trip(self.publisher, self.metrics, self.actor_id, timeout):
                return {"bus": "an event did not reach the metrics store"}
        except TimeoutError:
            return {"metrics": "not answering"}
        return {}

    async def attached_states(self, states: dict[str, str], timeout: float) -> dict[str, str]:
        """Each actor's state for an attached client: ``states`` (restarting while the supervisor
        said so on the bus), else what the metrics store saw of it (its lifecycle events, its pid)."""
        reachable = await self.store_reachable(timeout)
        states.update(reachable)
        if "metrics" in reachable:
            return states
        try:
            reply = await self.metrics.query(SeenQuery(), timeout=timeout)
        except TimeoutError:
            states["metrics"] = "not answering"
            return states
        actors = reply.actors if isinstance(reply, SeenReply) else {}
        expected = [*(worker_id(rank) for rank in range(len(self.info.addresses.workers))),
                    "kv_cache_manager", "scheduler"]
        if self.info.data_parallel_size > 1:  # a replica set: the controller and each replica's pipeline
            expected = [CONTROLLER, *(replica_actor(name, replica) for replica in range(self.info.data_parallel_size)
                                      for name in (worker_id(0), KV_CACHE_MANAGER, SCHEDULER))]
        unseen = []
        for actor in expected:
            seen = actors.get(actor)
            if actor in states:
                continue
            if seen is None:
                unseen.append(actor)  # a restarted store has not heard from it yet
                states[actor] = READY
            elif seen.state != "READY":
                states[actor] = f"state {seen.state}" + (f": {seen.error}" if seen.error else "")
            elif seen.pid is not None and not pid_alive(seen.pid):
                states[actor] = f"process {seen.pid} is gone"
            else:
                states[actor] = READY
        if unseen:
            states.setdefault("metrics", f"has not seen {', '.join(unseen)}")
        return states


async def follow_bus(context: zmq.asyncio.Context, bus_out: str, keys: GroupKeys | None, topics: list[str],
                     skip: Callable[[str], bool] = lambda topic: False) -> AsyncIterator[tuple[str, EventBatch]]:
    """(topic, batch) for each event batch of ``topics`` on the bus, until cancelled; undecodable
    frames, topics ``skip`` names, and batches whose actor is not their topic are passed over."""
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.LINGER, 0)
    for topic in topics:
        subscriber.setsockopt(zmq.SUBSCRIBE, topic.encode())
    connect(subscriber, bus_out, keys)
    decoder = msgspec.msgpack.Decoder(EventBatch)
    try:
        while True:
            frames = await subscriber.recv_multipart()
            topic = frames[0].decode(errors="replace") if len(frames) == 2 else ""
            if (topic not in topics and split_replica(topic)[0] not in topics) or skip(topic):
                continue
            try:
                batch = decoder.decode(frames[-1])
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if batch.actor == topic:
                yield topic, batch
    finally:
        subscriber.close()


class AsyncQueries:
    """The metrics and health calls of ``AsyncEngineClient``."""

    if TYPE_CHECKING:  # provided by AsyncEngineClient
        group: ProcessGroup | None
        _metrics: MetricsChannel
        _health: HealthProbe
        _supervision: SupervisionView
        _closed: bool
        _dead: BaseException | None

        @property
        def failed(self) -> str | None: ...

    async def query_metrics(self, query: MetricsQuery, timeout: float = 5.0) -> MetricsReply:
        """One query to the metrics store; raises TimeoutError when it does not answer."""
        return await self._metrics.query(query, timeout)

    async def get_metrics(self, replica: int | None = None) -> SummaryReply:
        """The metrics store's summary: the whole group's, or one replica's."""
        return expect_reply(await self.query_metrics(SummaryQuery(replica=replica)), SummaryReply)

    async def get_timeline(self, request_id: str) -> TimelineReply:
        return expect_reply(await self.query_metrics(TimelineQuery(request_id=request_id)), TimelineReply)

    async def health(self, timeout: float = 2.0) -> Health:
        """The verdict ``/health`` serves (``clients/async_health.py`` says how it is reached)."""
        if self._closed:
            return Health("unavailable", {"frontend": "shut down"})
        failure = self.failed
        if failure is not None:
            return classify({}, failure=failure)
        extra = {"frontend": f"reader stopped: {self._dead}"} if self._dead is not None else {}
        states = await self._health.states(self.group, dict(self._supervision.down), timeout)
        return classify(states, extra_unhealthy=extra)

    async def check_health(self, timeout: float = 2.0) -> dict[str, str]:
        """What is wrong, per part (empty: healthy): ``health()``'s problems, degraded ones included."""
        return (await self.health(timeout)).problems()
