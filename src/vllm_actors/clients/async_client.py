"""An asyncio client of a process group: the frontend's state machine on ``zmq.asyncio`` sockets.

``AsyncEngineClient`` starts a process group (``await AsyncEngineClient.start(model, ...)``) or
attaches to a running one (``await AsyncEngineClient.attach(run_dir_or_group_info)``). Inside any
asyncio application it tokenises, validates and submits requests to the scheduler over one DEALER
socket; one background task reads the scheduler's updates, runs them through the frontend
(detokenising, stop strings) and hands each request's cumulative ``RequestOutput`` to that
request's ``RequestStream``. A second task follows the scheduler's events on the bus for the queue
time of this client's requests.

The group's supervisor restarts actors that die or hang. After a scheduler restart the client sends
its unfinished requests again (resume=True, with the tokens each has received): their streams just
pause. When the group gives up, every open stream ends with a final output of finish reason
"error" (``RequestOutput.error`` says why) and ``submit`` raises ``EngineDeadError``. A client that
owns its group learns both from the group's listeners; an attached client from the supervisor's
ACTOR_RESTARTED and GROUP_FAILED events on the bus (``clients/supervision.py``).

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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import structlog
import zmq
import zmq.asyncio

from vllm_actors.clients import async_text
from vllm_actors.clients.async_health import AsyncQueries, HealthProbe, MetricsChannel, follow_bus
from vllm_actors.clients.async_requests import AsyncRequests
from vllm_actors.clients.core import (
    EngineDeadError,
    ZmqTransport,
    drop_work_events,
    frontend_for_group,
    group_info_of,
    load_group_tokenizer,
)
from vllm_actors.clients.engine_commands import AsyncEngineCommands
from vllm_actors.clients.engine_control import ControlCalls
from vllm_actors.clients.latency import LatencyTracker, StatsListener
from vllm_actors.clients.open_streams import OpenStreams
from vllm_actors.clients.request_stream import RequestStream
from vllm_actors.clients.supervision import (
    SupervisionView,
    call_soon,
    group_failure,
    is_scheduler,
    listen,
)
from vllm_actors.protocol.messages import AbortRequests, ControlReply
from vllm_actors.protocol.names import ENTRY_ACTORS, SCHEDULER, SUPERVISOR
from vllm_actors.runtime.run_dir import GroupInfo
from vllm_actors.runtime.security import connect, keys_for
from vllm_actors.runtime.zmq_shell import EventPublisher

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer
    from vllm_actors.runtime.supervisor import ProcessGroup

__all__ = ["AsyncEngineClient", "EngineDeadError", "RequestStream", "StatsListener", "load_group_tokenizer"]

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT = 30.0
RESTARTED_CLIENT = "client restarted"  # the abort reason of what a dead client under the same identity left
CLOSE_LINGER_MS = 500  # aborts sent just before closing still leave


class AsyncEngineClient(AsyncRequests, AsyncQueries, AsyncEngineCommands):
    """The frontend of a process group for asyncio applications (see the module docstring); vLLM's
    engine commands (``sleep``, ``wake_up``, ``is_sleeping``, ``reset_prefix_cache``) are
    ``AsyncEngineCommands``', the request calls ``AsyncRequests``' (``async_requests.py``), the metrics
    and health calls ``AsyncQueries``' (``async_health.py``)."""

    def __init__(
        self,
        info: GroupInfo,
        tokenizer: Tokenizer | None = None,
        *,
        group: ProcessGroup | None = None,
        load_tokenizer: bool = True,
        identity: str | None = None,
    ) -> None:
        """``identity``: the routing id of this client's connection to the scheduler (default: a
        new one); a client that takes over a dead one's (``attach(..., identity=...)``) drops
        what that one left running."""
        self.info = info
        self.group = group  # owned: shut down with the client
        if tokenizer is None and load_tokenizer:
            tokenizer = load_group_tokenizer(info)
        self.identity = identity or f"client-{os.getpid()}-{secrets.token_hex(4)}"
        self.actor_id = self.identity.replace("client", "frontend", 1)
        self.keys = keys_for(info.addresses, info.run_dir)  # TCP: the group's CURVE keys
        self._context = zmq.asyncio.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._dealer.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        connect(self._dealer, info.addresses.scheduler, self.keys)
        # PUB never blocks: a plain socket on the same underlying context.
        self._sync_context: zmq.Context = zmq.Context.shadow(self._context.underlying)
        self._publisher = EventPublisher(self._sync_context, info.addresses.bus_in, self.actor_id, keys=self.keys,
                                         drop_work_events=drop_work_events(info))
        transport = ZmqTransport(self._dealer, self._publisher)
        super().__init__(frontend_for_group(info, tokenizer), transport, self.identity)
        self._metrics = MetricsChannel(self._context, info.addresses.metrics, self.keys)
        self._health = HealthProbe(info, self._publisher, self._metrics, self.actor_id)
        self.latency = LatencyTracker()
        self._streams = OpenStreams(self.latency)
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._dead: BaseException | None = None
        self._supervision = SupervisionView()  # an attached client's view, from the bus
        self._failure_listeners: list[Callable[[str], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None  # where the group's listeners hand over
        self._text = async_text.TextPool(self.identity)
        self._controls = ControlCalls()

    # ------------------------------------------------------------------ construction
    @classmethod
    async def start(
        cls,
        model: str | None = None,
        *,
        check_invariants: bool = False,
        start_timeout: float = 300.0,
        supervision: Mapping[str, Any] | None = None,
        **engine_args: Any,
    ) -> AsyncEngineClient:
        """Start a process group (engine arguments with vLLM's names) and connect to it; the
        client owns the group and stops it on ``shutdown()``. ``supervision``: ``ProcessGroup``'s
        knobs (``max_restarts``, ``restart_window``, ``liveness_timeout``, ``max_busy_seconds``)."""
        from vllm_actors.engine_args import make_engine_config
        from vllm_actors.runtime.supervisor import ProcessGroup

        config = make_engine_config(model, engine_args)
        group = ProcessGroup(config, check_invariants=check_invariants, start_timeout=start_timeout,
                             **dict(supervision or {}))
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
    async def attach(cls, target: str | os.PathLike[str] | GroupInfo | None = None, *,
                     identity: str | None = None) -> AsyncEngineClient:
        """Attach to a running group: its run directory, its ``GroupInfo``, or (None) the newest
        running group. The group keeps running after ``shutdown()``. ``identity``: take over the
        connection of a client that died under that routing id, aborting every request it left
        (reason "client restarted"): nobody reads their tokens any more."""
        info = group_info_of(target)
        tokenizer = await asyncio.to_thread(load_group_tokenizer, info)
        client = cls(info, tokenizer, load_tokenizer=False, identity=identity)
        try:
            if identity is not None:
                client.transport.send(SCHEDULER, AbortRequests(request_ids=[], reason=RESTARTED_CLIENT,
                                                               all_of_sender=True))
            await client.connect()
        except BaseException:
            await client.shutdown()
            raise
        return client

    async def connect(self, timeout: float = CONNECT_TIMEOUT) -> None:
        """Start the background tasks and wait until the metrics store sees this client's events
        (PUB/SUB drops what is published before the subscription is in place)."""
        self._ensure_tasks()
        await self._health.wait_seen(timeout)

    def _ensure_tasks(self) -> None:
        if self._tasks or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._listen_to_group(loop)
        reader = loop.create_task(self._read_updates(), name=f"{self.identity}-reader")
        reader.add_done_callback(self._on_reader_done)
        watcher = loop.create_task(self._watch_bus(), name=f"{self.identity}-bus")
        self._tasks = [reader, watcher]

    def _listen_to_group(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.group is None or self._loop is not None:
            return
        self._loop = loop
        listen(self.group, self._restart_reported, self._failure_reported)

    # The owned group's supervisor calls these on its own thread: hand each call to the loop.
    def _restart_reported(self, actor: str) -> None:
        if self._loop is not None:
            call_soon(self._loop, self._on_actor_restarted, actor)

    def _failure_reported(self, reason: str) -> None:
        if self._loop is not None:
            call_soon(self._loop, self._fail, reason)

    # ------------------------------------------------------------------ facts
    @property
    def model(self) -> str:
        return self.info.model

    @property
    def max_num_seqs(self) -> int | None:
        """Sequences the engine runs at once: every replica's ``max_num_seqs``."""
        if self.group is None:
            return None
        config = self.group.config
        return config.max_num_seqs * getattr(config, "data_parallel_size", 1)  # a group of one replica may not say

    @property
    def num_unfinished(self) -> int:
        """Engine requests (n>1 counts n) of this client not finished yet."""
        return self._streams.num_engine_requests

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def failed(self) -> str | None:
        """Why the engine failed for good (the group gave up), or None while it serves."""
        if self.failure is None and self.group is not None:
            reason = group_failure(self.group)
            if reason is not None:  # the listener's call may still be on its way to the loop
                self._fail(reason)
        return self.failure

    def add_failure_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(reason)`` is called (on the event loop) once the group has failed, after every
        open stream has got its error output."""
        self._failure_listeners.append(listener)

    def add_stats_listener(self, listener: StatsListener) -> None:
        self.latency.listeners.append(listener)

    # ------------------------------------------------------------------ requests (the calls: async_requests.py)
    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the client has been shut down")
        if self.failed is not None:
            raise EngineDeadError(f"the engine failed: {self.failure}")
        if self._dead is not None:
            raise EngineDeadError(f"the client lost its engine: {self._dead}")

    # ------------------------------------------------------------------ supervision (on the loop)
    def _on_actor_restarted(self, actor: str) -> None:
        if actor in ENTRY_ACTORS and not self._closed and self.failure is None:
            self.resubmit_open()

    def _fail(self, reason: str) -> None:
        """The group failed: every open stream ends with an error output; new requests are refused."""
        if self.failure is not None or self._closed:
            return
        self._streams.dispatch(self.fail_open(reason), time.monotonic())
        self._streams.end_all(lambda stream: stream._errored(reason))  # none left, unless one was never submitted
        for listener in list(self._failure_listeners):
            try:
                listener(reason)
            except Exception:
                log.exception("failure listener failed", actor=self.identity)

    # ------------------------------------------------------------------ background tasks
    async def _read_updates(self) -> None:
        while True:
            payload = await self._dealer.recv()
            now = time.monotonic()
            try:
                message = self._decode_frame(payload)
                if message is None:
                    continue
                if isinstance(message, ControlReply):
                    self._controls.resolve(message)
                    continue
                self.latency.on_transit(message, now)
                outputs = self._receive(message)
            except Exception:  # a bug here must not silence every other request
                log.exception("updates not handled", actor=self.identity)
                continue
            self._streams.dispatch(outputs, now)

    async def _watch_bus(self) -> None:
        """Follow the scheduler's events (queue times for the stats listeners) and, for an attached
        client, the supervisor's (restarts, the group's failure), until cancelled."""
        topics = [SCHEDULER] if self.group is not None else [SCHEDULER, SUPERVISOR]  # an owned group tells us
        async for topic, batch in follow_bus(self._context, self.info.addresses.bus_out, self.keys, topics,
                                             skip=lambda topic: is_scheduler(topic)
                                             and not self.latency.wants_scheduler_events):
            if is_scheduler(topic):  # "scheduler" subscribes to every replica's ("scheduler@1")
                self.latency.on_scheduler_events(batch)
                continue
            restarted, failed = self._supervision.on_batch(topic, batch)
            if failed is not None:
                self._fail(failed)
            for actor in restarted:
                self._on_actor_restarted(actor)

    def _on_reader_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            error: BaseException = EngineDeadError("the client was shut down")
        else:
            error = task.exception() or EngineDeadError("the reader stopped")
            log.error("client reader stopped", actor=self.identity, error=repr(error))
        self._dead = error
        self._controls.fail_all(EngineDeadError(f"the client lost its engine: {error}"))
        self._streams.end_all(lambda stream: stream._fail(EngineDeadError(f"the client lost its engine: {error}")))

    async def control(self, action: str, **fields: Any) -> ControlReply:
        """An engine command (``EngineControl``'s actions and fields: ``"sleep"``, level=1; ``"wake_up"``,
        tags=[...]; ``"reset_prefix_cache"``; ``"is_sleeping"``; ``"start_profile"``/``"stop_profile"``),
        answered by the engine; raises TimeoutError when it does not answer."""
        self._check_alive()
        self._ensure_tasks()
        control, answer = self._controls.make(action, **fields)
        self.transport.send(SCHEDULER, control)
        return await self._controls.wait(control, answer)

    # ------------------------------------------------------------------ lifetime
    async def shutdown(self, reason: str = "shutdown") -> None:
        """Abort this client's unfinished requests, close the sockets and, when the client
        started the group, stop every actor. Idempotent."""
        if self._closed:
            return
        for request_id in self._streams.request_ids():
            self.abort(request_id, reason)
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        self._text.close()
        self._publisher.close()
        self._metrics.close()
        self._dealer.close(linger=CLOSE_LINGER_MS)
        await asyncio.to_thread(self._context.term)
        if self.group is not None:
            await asyncio.to_thread(self.group.shutdown)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

