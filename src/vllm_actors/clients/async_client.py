"""An asyncio client of a process group: the frontend's state machine on ``zmq.asyncio`` sockets.

``AsyncEngineClient`` starts a process group (``await AsyncEngineClient.start(model, ...)``) or
attaches to a running one (``await AsyncEngineClient.attach(run_dir_or_group_info)``). Inside any
asyncio application it tokenises, validates and submits requests to the scheduler over one DEALER
socket; one background task reads the scheduler's updates, runs them through the frontend
(detokenising, stop strings) and hands each request's cumulative ``RequestOutput`` to that
request's ``RequestStream``. A second task follows the scheduler's events on the bus for the queue
time of this client's requests.

    client = await AsyncEngineClient.start("path/to/model", dtype="float32")
    async for output in client.generate("Hello", SamplingParams(max_tokens=16)):
        print(output.outputs[0].text)          # cumulative, like vLLM
    await client.shutdown()

Everything runs on the event loop's thread: the frontend state machine needs no lock.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import zmq
import zmq.asyncio

from vllm_actors.actors.frontend.frontend import PreparedRequest
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.frontend.text import PromptInput
from vllm_actors.clients.core import ClientCore, ZmqTransport, expect_reply, frontend_for_group, load_group_tokenizer
from vllm_actors.clients.latency import LatencyTracker, StatsListener
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.protocol.events import Heartbeat
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
from vllm_actors.protocol.names import worker_id
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runtime.run_dir import GroupInfo, find_running_group, pid_alive, read_group_info
from vllm_actors.runtime.zmq_shell import EventPublisher

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer
    from vllm_actors.runtime.supervisor import ProcessGroup

__all__ = ["AsyncEngineClient", "EngineDeadError", "RequestStream", "StatsListener", "load_group_tokenizer"]

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT = 30.0
CLOSE_LINGER_MS = 500  # aborts sent just before closing still leave


class EngineDeadError(RuntimeError):
    """The client lost its engine (its reader stopped or it was shut down)."""


class AsyncEngineClient(ClientCore):
    """The frontend of a process group for asyncio applications (see the module docstring)."""

    def __init__(
        self,
        info: GroupInfo,
        tokenizer: Tokenizer | None = None,
        *,
        group: ProcessGroup | None = None,
        load_tokenizer: bool = True,
    ) -> None:
        self.info = info
        self.group = group  # owned: shut down with the client
        if tokenizer is None and load_tokenizer:
            tokenizer = load_group_tokenizer(info)
        self.identity = f"client-{os.getpid()}-{secrets.token_hex(4)}"
        self.actor_id = self.identity.replace("client", "frontend", 1)
        self._context = zmq.asyncio.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._dealer.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        self._dealer.connect(info.addresses.scheduler)
        # PUB never blocks: a plain socket on the same underlying context.
        self._sync_context: zmq.Context = zmq.Context.shadow(self._context.underlying)
        self._publisher = EventPublisher(self._sync_context, info.addresses.bus_in, self.actor_id)
        transport = ZmqTransport(self._dealer, self._publisher)
        super().__init__(frontend_for_group(info, tokenizer), transport, self.identity)
        self._metrics: zmq.asyncio.Socket = self._metrics_socket()
        self._metrics_lock = asyncio.Lock()
        self._metrics_codec = MetricsCodec()
        self._streams: dict[str, RequestStream] = {}
        self.latency = LatencyTracker()
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._dead: BaseException | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    async def start(
        cls,
        model: str | None = None,
        *,
        check_invariants: bool = False,
        start_timeout: float = 300.0,
        **engine_args: Any,
    ) -> AsyncEngineClient:
        """Start a process group (engine arguments with vLLM's names) and connect to it; the
        client owns the group and stops it on ``shutdown()``."""
        from vllm_actors.llm import make_engine_config
        from vllm_actors.runtime.supervisor import ProcessGroup

        config = make_engine_config(model, engine_args)
        group = ProcessGroup(config, check_invariants=check_invariants, start_timeout=start_timeout)
        try:
            await asyncio.to_thread(group.start)
            tokenizer = await asyncio.to_thread(load_group_tokenizer, group.info)
            client = cls(group.info, tokenizer, group=group, load_tokenizer=False)
            await client.connect()
        except BaseException:
            group.shutdown()
            raise
        return client

    @classmethod
    async def attach(cls, target: str | os.PathLike[str] | GroupInfo | None = None) -> AsyncEngineClient:
        """Attach to a running group: its run directory, its ``GroupInfo``, or (None) the newest
        running group. The group keeps running after ``shutdown()``."""
        if isinstance(target, GroupInfo):
            info = target
        elif target is None:
            info = find_running_group()
        else:
            info = read_group_info(Path(target))
        tokenizer = await asyncio.to_thread(load_group_tokenizer, info)
        client = cls(info, tokenizer, load_tokenizer=False)
        try:
            await client.connect()
        except BaseException:
            await client.shutdown()
            raise
        return client

    async def connect(self, timeout: float = CONNECT_TIMEOUT) -> None:
        """Start the background tasks and wait until the metrics store sees this client's events
        (PUB/SUB drops what is published before the subscription is in place)."""
        self._ensure_tasks()
        deadline = time.monotonic() + timeout
        while True:
            try:
                if await self._bus_round_trip(timeout=1.0):
                    return
            except TimeoutError:  # a store slow to answer (a loaded machine): ask again until the deadline
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the metrics store did not see {self.actor_id}'s events within {timeout:.0f} s")

    def _ensure_tasks(self) -> None:
        if self._tasks or self._closed:
            return
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_updates(), name=f"{self.identity}-reader")
        reader.add_done_callback(self._on_reader_done)
        watcher = loop.create_task(self.latency.follow_scheduler(self._context, self.info.addresses.bus_out),
                                   name=f"{self.identity}-bus")
        self._tasks = [reader, watcher]

    def _metrics_socket(self) -> zmq.asyncio.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self.info.addresses.metrics)
        return socket

    # ------------------------------------------------------------------ facts
    @property
    def model(self) -> str:
        return self.info.model

    @property
    def max_num_seqs(self) -> int | None:
        return self.group.config.max_num_seqs if self.group is not None else None

    @property
    def num_unfinished(self) -> int:
        """Engine requests (n>1 counts n) of this client not finished yet."""
        return sum(stream.prepared.params.n for stream in self._streams.values())

    @property
    def is_closed(self) -> bool:
        return self._closed

    def add_stats_listener(self, listener: StatsListener) -> None:
        self.latency.listeners.append(listener)

    # ------------------------------------------------------------------ requests
    def submit(self, prepared: PreparedRequest) -> RequestStream:
        """Send a prepared request to the scheduler; its outputs arrive on the returned stream."""
        self._check_alive()
        self._ensure_tasks()
        stream = RequestStream(self, prepared)
        self._submit(prepared)
        self._streams[prepared.request_id] = stream
        self.latency.start(prepared.request_id, time.monotonic())
        return stream

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> RequestStream:
        return self.submit(self.prepare(request_id, prompt, params))

    async def generate(
        self,
        prompt: PromptInput,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        cancel_reason: str = "abort",
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request, the last one finished. Leaving the iteration early
        (break, cancellation, a closed generator) aborts the request with ``cancel_reason``."""
        stream = self.add_request(request_id or secrets.token_hex(8), prompt, sampling_params or SamplingParams())
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort(cancel_reason)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Abort a request of this client: the scheduler drops it (ABORTED(reason) on the bus) and
        its KV blocks are freed with the next plan. Unknown or finished ids are ignored."""
        stream = self._streams.pop(request_id, None)
        self.latency.forget(request_id)
        if self._closed:
            return
        self._abort(request_id, reason)
        if stream is not None:
            stream._aborted()

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the client has been shut down")
        if self._dead is not None:
            raise EngineDeadError(f"the client lost its engine: {self._dead}")

    # ------------------------------------------------------------------ background tasks
    async def _read_updates(self) -> None:
        while True:
            payload = await self._dealer.recv()
            now = time.monotonic()
            try:
                outputs = self._receive_frame(payload)
            except Exception:  # a bug here must not silence every other request
                log.exception("updates not handled", actor=self.identity)
                continue
            for output in outputs:
                self.latency.on_output(output, now)
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                stream._put(output)
                if output.finished:
                    del self._streams[output.request_id]

    def _on_reader_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            error: BaseException = EngineDeadError("the client was shut down")
        else:
            error = task.exception() or EngineDeadError("the reader stopped")
            log.error("client reader stopped", actor=self.identity, error=repr(error))
        self._dead = error
        for stream in list(self._streams.values()):
            stream._fail(EngineDeadError(f"the client lost its engine: {error}"))
        self._streams.clear()
        self.latency.clear()

    # ------------------------------------------------------------------ metrics and health
    async def query_metrics(self, query: MetricsQuery, timeout: float = 5.0) -> MetricsReply:
        """One query to the metrics store; raises TimeoutError when it does not answer."""
        async with self._metrics_lock:
            await self._metrics.send(self._metrics_codec.encode(query))
            try:
                payload = await asyncio.wait_for(self._metrics.recv(), timeout)
            except asyncio.TimeoutError:
                # A late reply would answer the next query: start over on a fresh socket.
                self._metrics.close(linger=0)
                self._metrics = self._metrics_socket()
                raise TimeoutError("the metrics store did not answer") from None
            return self._metrics_codec.decode_reply(payload)

    async def get_metrics(self) -> SummaryReply:
        return expect_reply(await self.query_metrics(SummaryQuery()), SummaryReply)

    async def get_timeline(self, request_id: str) -> TimelineReply:
        return expect_reply(await self.query_metrics(TimelineQuery(request_id=request_id)), TimelineReply)

    async def _bus_round_trip(self, timeout: float) -> bool:
        """Publish a heartbeat and wait until the metrics store has seen it (bus and store alive)."""
        self._publisher.publish([Heartbeat(pid=os.getpid())])
        wanted = self._publisher.stamper.next_seq - 1
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            reply = await self.query_metrics(SeenQuery(actor=self.actor_id), timeout=remaining)
            seen = reply.actors.get(self.actor_id) if isinstance(reply, SeenReply) else None
            if seen is not None and seen.last_seq >= wanted:
                return True
            await asyncio.sleep(0.01)

    async def check_health(self, timeout: float = 2.0) -> dict[str, str]:
        """What is wrong, per actor (empty: healthy). Every process must be alive, every engine
        actor READY in the metrics store, and an event from this client must reach the store
        through the bus within ``timeout``."""
        problems: dict[str, str] = {}
        if self._closed:
            return {"frontend": "shut down"}
        if self._dead is not None:
            problems["frontend"] = f"reader stopped: {self._dead}"
        if self.group is not None:
            for actor, alive in self.group.alive().items():
                if not alive:
                    problems[actor] = "process exited"
        try:
            if not await self._bus_round_trip(timeout):
                problems.setdefault("bus", "an event did not reach the metrics store")
            reply = await self.query_metrics(SeenQuery(), timeout=timeout)
        except TimeoutError:
            problems.setdefault("metrics", "not answering")
            return problems
        actors = reply.actors if isinstance(reply, SeenReply) else {}
        expected = ["metrics", *(worker_id(rank) for rank in range(len(self.info.addresses.workers))),
                    "kv_cache_manager", "scheduler"]
        for actor in expected:
            seen = actors.get(actor)
            if seen is None:
                problems.setdefault(actor, "never seen by the metrics store")
            elif seen.state != "READY":
                problems.setdefault(actor, f"state {seen.state}" + (f": {seen.error}" if seen.error else ""))
            elif seen.pid is not None and not pid_alive(seen.pid):
                problems.setdefault(actor, f"process {seen.pid} is gone")
        return problems

    # ------------------------------------------------------------------ lifetime
    async def shutdown(self, reason: str = "shutdown") -> None:
        """Abort this client's unfinished requests, close the sockets and, when the client
        started the group, stop every actor. Idempotent."""
        if self._closed:
            return
        for request_id in list(self._streams):
            self.abort(request_id, reason)
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._publisher.close()
        self._metrics.close(linger=0)
        self._dealer.close(linger=CLOSE_LINGER_MS)
        await asyncio.to_thread(self._context.term)
        if self.group is not None:
            await asyncio.to_thread(self.group.shutdown)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()
