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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import structlog
import zmq
import zmq.asyncio

from vllm_actors.actors.frontend.frontend import PreparedRequest, PromptInput
from vllm_actors.clients.sync_client import frontend_for_group
from vllm_actors.actors.frontend.outputs import CompletionOutput, RequestOutput
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import EventBatch, Heartbeat, Queued, Scheduled
from vllm_actors.protocol.messages import RequestUpdates
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
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runtime.run_dir import GroupInfo, find_running_group, read_group_info
from vllm_actors.runtime.transport import route_frontend_outputs
from vllm_actors.protocol.names import parent_request_id, worker_id
from vllm_actors.runtime.zmq_shell import EventPublisher

if TYPE_CHECKING:
    from vllm_actors.runtime.supervisor import ProcessGroup
    from vllm_actors.actors.frontend.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

CONNECT_TIMEOUT = 30.0
CLOSE_LINGER_MS = 500  # aborts sent just before closing still leave


class EngineDeadError(RuntimeError):
    """The client lost its engine (its reader stopped or it was shut down)."""


class StatsListener(Protocol):
    """Receives latency samples of this client's requests, in seconds: ``"ttft"``, ``"itl"``
    (one per step that brought tokens), ``"e2e"`` and ``"queue"`` (QUEUED to SCHEDULED)."""

    def observe(self, metric: str, seconds: float) -> None: ...


@dataclass
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    queued: dict[str, float] = field(default_factory=dict)  # engine id -> QUEUED (scheduler mono)


class RequestStream:
    """The outputs of one request, as an async iterator of cumulative ``RequestOutput``.

    Outputs are cumulative, so a consumer slower than the engine loses nothing by seeing only the
    newest one: each ``__anext__`` returns the latest output not yet returned. The iteration ends
    after the finished output (finish reasons "stop", "length", "abort" or "error")."""

    def __init__(self, client: AsyncEngineClient, prepared: PreparedRequest) -> None:
        self.client = client
        self.request_id = prepared.request_id
        self.prepared = prepared
        self.finished = False  # the finished output has been received
        self._latest: RequestOutput | None = None
        self._last: RequestOutput | None = None
        self._ready = asyncio.Event()
        self._returned_final = False
        self._error: BaseException | None = None

    def _put(self, output: RequestOutput) -> None:
        self._latest = output
        self._last = output
        self.finished = self.finished or output.finished
        self._ready.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True
        self._ready.set()

    def _aborted(self) -> None:
        """The request was aborted here: end the iteration with an output saying so."""
        if self.finished:
            return
        last = self._last
        n = self.prepared.params.n
        previous = {c.index: c for c in last.outputs} if last is not None else {}
        outputs = []
        for index in range(n):
            child = previous.get(index)
            if child is None:
                child = CompletionOutput(index=index, text="", token_ids=[], cumulative_logprob=None, logprobs=None)
            elif child.finish_reason is None:
                child = CompletionOutput(index=index, text=child.text, token_ids=list(child.token_ids),
                                         cumulative_logprob=child.cumulative_logprob, logprobs=child.logprobs)
            if child.finish_reason is None:
                child.finish_reason = "abort"
            outputs.append(child)
        self._put(RequestOutput(
            request_id=self.request_id,
            prompt=self.prepared.prompt,
            prompt_token_ids=self.prepared.prompt_token_ids,
            prompt_logprobs=last.prompt_logprobs if last is not None else None,
            outputs=outputs,
            finished=True,
        ))

    def abort(self, reason: str = "abort") -> None:
        """Abort the request unless it has finished (no-op then)."""
        if not self.finished:
            self.client.abort(self.request_id, reason)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._returned_final:
                raise StopAsyncIteration
            if self._latest is None and self._error is None:
                self._ready.clear()
                await self._ready.wait()
            if self._error is not None:
                self._returned_final = True
                raise self._error
            output, self._latest = self._latest, None
            if output is None:
                continue
            if output.finished:
                self._returned_final = True
            return output


class AsyncEngineClient:
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
        if tokenizer is None and load_tokenizer and info.tokenizer is not None:
            from vllm_actors.actors.frontend.tokenizer import load_tokenizer as load

            tokenizer = load(info.tokenizer)
        self.tokenizer = tokenizer
        self.frontend = frontend_for_group(info, tokenizer)
        self.identity = f"client-{os.getpid()}-{secrets.token_hex(4)}"
        self.actor_id = self.identity.replace("client", "frontend", 1)
        self._context = zmq.asyncio.Context()
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.IDENTITY, self.identity.encode())
        self._dealer.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        self._dealer.connect(info.addresses.scheduler)
        # PUB never blocks: a plain socket on the same underlying context.
        self._sync_context = zmq.Context.shadow(self._context.underlying)
        self._publisher = EventPublisher(self._sync_context, info.addresses.bus_in, self.actor_id)
        self._metrics: zmq.asyncio.Socket = self._metrics_socket()
        self._metrics_lock = asyncio.Lock()
        self._codec = MessageCodec()
        self._metrics_codec = MetricsCodec()
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self._listeners: list[StatsListener] = []
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
        while not await self._bus_round_trip(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the metrics store did not see {self.actor_id}'s events within {timeout:.0f} s")

    def _ensure_tasks(self) -> None:
        if self._tasks or self._closed:
            return
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read_updates(), name=f"{self.identity}-reader")
        reader.add_done_callback(self._on_reader_done)
        watcher = loop.create_task(self._watch_scheduler_events(), name=f"{self.identity}-bus")
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
    def max_model_len(self) -> int:
        return self.frontend.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.frontend.vocab_size

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
        self._listeners.append(listener)

    # ------------------------------------------------------------------ requests
    def prepare(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> PreparedRequest:
        """Tokenise and validate (raises ValueError naming the field); queues nothing."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.frontend.prepare(request_id, prompt, params)

    def submit(self, prepared: PreparedRequest) -> RequestStream:
        """Send a prepared request to the scheduler; its outputs arrive on the returned stream."""
        self._check_alive()
        self._ensure_tasks()
        stream = RequestStream(self, prepared)
        messages = self.frontend.submit(prepared)
        self._streams[prepared.request_id] = stream
        self._timings[prepared.request_id] = _Timing(arrival=time.monotonic())
        self._send(messages)
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
        self._timings.pop(request_id, None)
        if self._closed:
            return
        self._send(self.frontend.abort(request_id, reason))
        if stream is not None:
            stream._aborted()

    def _send(self, outputs: list[tuple[str, Any]]) -> list[Any]:
        client_outputs, onward = route_frontend_outputs(outputs, self._publisher.publish)
        for _, message in onward:  # everything onward goes to the scheduler
            sent = self._dealer.send(self._codec.encode(message))
            if not sent.done():  # queued behind the high-water mark: sent in order later
                sent.add_done_callback(_log_send_failure)
        return client_outputs

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the client has been shut down")
        if self._dead is not None:
            raise EngineDeadError(f"the client lost its engine: {self._dead}")

    # ------------------------------------------------------------------ background tasks
    async def _read_updates(self) -> None:
        while True:
            payload = await self._dealer.recv()
            try:
                message = self._codec.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                log.warning("frame dropped", actor=self.identity, why="undecodable", error=str(error))
                continue
            if not isinstance(message, RequestUpdates):
                log.warning("frame dropped", actor=self.identity, why="unexpected type", type=type(message).__name__)
                continue
            now = time.monotonic()
            try:
                outputs = self._send(self.frontend.handle(message))
            except Exception:  # a bug here must not silence every other request
                log.exception("updates not handled", actor=self.identity, step=message.step_id)
                continue
            for output in outputs:
                self._dispatch(output, now)

    def _dispatch(self, output: RequestOutput, now: float) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        timing = self._timings.get(output.request_id)
        if timing is not None and self._listeners:
            self._observe_progress(timing, output, now)
        stream._put(output)
        if output.finished:
            del self._streams[output.request_id]
            self._timings.pop(output.request_id, None)

    def _observe_progress(self, timing: _Timing, output: RequestOutput, now: float) -> None:
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        if num_tokens > timing.num_tokens:
            if timing.first_token is None:
                timing.first_token = now
                self._emit("ttft", now - timing.arrival)
            elif timing.last_token is not None:
                self._emit("itl", now - timing.last_token)
            timing.last_token = now
            timing.num_tokens = num_tokens
        if output.finished and output.error is None:
            self._emit("e2e", now - timing.arrival)

    def _emit(self, metric: str, seconds: float) -> None:
        for listener in self._listeners:
            try:
                listener.observe(metric, seconds)
            except Exception:
                log.exception("stats listener failed", metric=metric)

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
        self._timings.clear()

    async def _watch_scheduler_events(self) -> None:
        """QUEUED -> SCHEDULED of this client's requests, from the scheduler's events (one clock)."""
        subscriber = self._context.socket(zmq.SUB)
        subscriber.setsockopt(zmq.LINGER, 0)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"scheduler")
        subscriber.connect(self.info.addresses.bus_out)
        decoder = msgspec.msgpack.Decoder(EventBatch)
        try:
            while True:
                frames = await subscriber.recv_multipart()
                if not self._listeners or not self._timings:
                    continue
                try:
                    batch = decoder.decode(frames[-1])
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                for event in batch.events:
                    if isinstance(event, Queued | Scheduled):
                        timing = self._timings.get(parent_request_id(event.request_id))
                        if timing is None:
                            continue
                        if isinstance(event, Queued):
                            timing.queued[event.request_id] = batch.mono
                        elif event.request_id in timing.queued:
                            self._emit("queue", max(batch.mono - timing.queued.pop(event.request_id), 0.0))
        finally:
            subscriber.close()

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
        reply = await self.query_metrics(SummaryQuery())
        if not isinstance(reply, SummaryReply):
            raise RuntimeError(f"the metrics store answered {reply!r}")
        return reply

    async def get_timeline(self, request_id: str) -> TimelineReply:
        reply = await self.query_metrics(TimelineQuery(request_id=request_id))
        if not isinstance(reply, TimelineReply):
            raise RuntimeError(f"the metrics store answered {reply!r}")
        return reply

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
            elif seen.pid is not None and not _pid_alive(seen.pid):
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


def load_group_tokenizer(info: GroupInfo) -> Tokenizer | None:
    """The tokenizer a group names in its GroupInfo (None when it skips tokenizer init)."""
    if info.tokenizer is None:
        return None
    from vllm_actors.actors.frontend.tokenizer import load_tokenizer

    return load_tokenizer(info.tokenizer)


def _log_send_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("send to the scheduler failed", error=repr(future.exception()))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

