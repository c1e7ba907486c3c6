"""The client core: what every client of the engine shares.

A client is the frontend state machine (``actors/frontend``: text in, text out) plus a way to
reach the engine. ``ClientCore`` owns the frontend and the client's paths, written once:

* send: requests and aborts go through the frontend; its events are published on the bus first
  (ARRIVED happens before the scheduler hears of the request), then its messages go onward;
* receive: the scheduler's ``RequestUpdates`` (a wire frame, or an object in process) go through
  the frontend into deltas (``OutputDelta``: what is new per request), assembled here into vLLM's
  cumulative ``RequestOutput`` objects by appending; a malformed frame is dropped with a log line;
* metrics: ``expect_reply`` checks what the metrics store answered.

A ``Transport`` says how events and messages leave: the in-memory network (``InProcessEngine``)
or ZMQ sockets, plain (``EngineClient``) or asyncio (``AsyncEngineClient``). ``SyncClient`` is
what the offline ``LLM`` drives: the in-process engine or the ZMQ client of a process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import msgspec
import structlog
import zmq

from vllm_actors.actors.frontend.cumulative import CumulativeOutputs
from vllm_actors.actors.frontend.frontend import Frontend, PreparedRequest
from vllm_actors.actors.frontend.outputs import OutputDelta, RequestOutput
from vllm_actors.actors.frontend.text import ChatMessages, PromptInput
from vllm_actors.clients.engine_commands import SyncEngineCommands
from vllm_actors.clients.engine_control import CONTROL_TIMEOUT, checked_reply, new_control
from vllm_actors.envs import envs
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.messages import ControlReply, Message, RequestUpdates
from vllm_actors.protocol.metrics import (
    MetricsQuery,
    MetricsReply,
    SummaryQuery,
    SummaryReply,
    TimelineQuery,
    TimelineReply,
)
from vllm_actors.protocol.names import CLIENT, SCHEDULER
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer
    from vllm_actors.runtime.run_dir import GroupInfo
    from vllm_actors.runtime.zmq_shell import EventPublisher

log = structlog.get_logger(__name__)

R = TypeVar("R", bound=MetricsReply)


class Transport(Protocol):
    """How a client's frontend reaches the engine: events onto the bus, messages onward."""

    def publish(self, events: list[Any]) -> object: ...

    def send(self, destination: str, message: Message) -> None: ...


class ZmqTransport:
    """Events through a PUB socket to the bus, every message through a DEALER socket to the
    scheduler (the only peer a client has). The DEALER may be a ``zmq.asyncio`` socket: a send
    queued behind its high-water mark then completes later, in order, and a failure is logged."""

    def __init__(self, dealer: zmq.Socket, publisher: EventPublisher) -> None:
        self.dealer = dealer
        self.publisher = publisher
        self._codec = MessageCodec()

    def publish(self, events: list[Any]) -> object:
        return self.publisher.publish(events)

    def send(self, destination: str, message: Message) -> None:
        sent = self.dealer.send(self._codec.encode(message))
        if isinstance(sent, asyncio.Future) and not sent.done():
            sent.add_done_callback(_log_send_failure)


class EngineDeadError(RuntimeError):
    """The client lost its engine for good: the process group failed (its supervisor gave up),
    the client was shut down, or its reader stopped."""


class ClientCore:
    """The frontend state machine and the one send path and receive path of every client."""

    def __init__(self, frontend: Frontend, transport: Transport, name: str) -> None:
        self.frontend = frontend
        self.transport = transport
        self.name = name  # for log lines
        self._codec = MessageCodec()
        self._cumulative = CumulativeOutputs()  # open requests' outputs, assembled from the frontend's deltas
        # Why the engine is gone for good (the group failed), once it is: open requests have
        # ended with finish reason "error" and new ones are refused.
        self.failure: str | None = None
        self.control_replies: dict[str, ControlReply] = {}  # engine commands answered, until taken
        self._held: list[RequestOutput] = []  # outputs a sync client's control received, for its next poll

    # ------------------------------------------------------------------ facts
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.frontend.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.frontend.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.frontend.vocab_size

    # ------------------------------------------------------------------ requests out
    def prepare(
        self, request_id: str, prompt: PromptInput, params: SamplingParams, *, max_tokens_must_fit: bool = False
    ) -> PreparedRequest:
        """Tokenise and validate (raises ValueError naming the field); queues nothing."""
        return self.frontend.prepare(request_id, prompt, params, max_tokens_must_fit=max_tokens_must_fit)

    def prepare_chat(
        self,
        request_id: str,
        messages: ChatMessages,
        params: SamplingParams,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_tokens_must_fit: bool = False,
    ) -> PreparedRequest:
        """``prepare`` for a conversation, through the model's chat template."""
        return self.frontend.prepare_chat(
            request_id, messages, params, add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs, max_tokens_must_fit=max_tokens_must_fit,
        )

    def _submit(self, prepared: PreparedRequest) -> None:
        """Register the request with the frontend and send it on. If sending fails part-way (a
        value the wire cannot carry, a socket error), the request is taken back: the frontend
        forgets it and the scheduler is told to drop what already reached it, so nothing stays
        counted as in flight."""
        if prepared.arrival_time is None and (prepared.ttft_target_ms is not None
                                              or prepared.e2e_target_ms is not None):
            prepared = dataclasses.replace(prepared, arrival_time=time.time())  # the deadlines' origin
        messages = self.frontend.submit(prepared)
        try:
            self._send(messages)
        except BaseException:
            with contextlib.suppress(Exception):
                self._abort(prepared.request_id, "error")
            raise

    def _abort(self, request_id: str, reason: str = "abort") -> None:
        """Unknown or finished ids are ignored."""
        self._cumulative.forget(request_id)
        self._send(self.frontend.abort(request_id, reason))

    def _send(self, outputs: Outputs) -> list[RequestOutput]:
        """Publish the frontend's events first (ARRIVED happens before the scheduler hears of the
        request), send its messages on, and return the cumulative outputs of its deltas."""
        client = [self._cumulative.add(cast(OutputDelta, delta)) for delta in outputs.to(CLIENT)]
        if outputs.events:
            self.transport.publish(outputs.events)
        for destination, message in outputs.messages:
            if destination != CLIENT:
                self.transport.send(destination, message)
        return client

    # ------------------------------------------------------------------ recovery
    def resubmit_open(self) -> int:
        """The scheduler was restarted: send every unfinished engine request again (resume=True,
        with the tokens received so far). Returns how many were sent."""
        outputs = self.frontend.resubmit()
        self._send(outputs)
        if outputs.messages:
            log.info("requests resubmitted", actor=self.name, count=len(outputs.messages))
        return len(outputs.messages)

    def fail_open(self, reason: str) -> list[RequestOutput]:
        """The engine failed for good: remember why (new requests are refused) and end every open
        request with finish reason "error" and ``reason`` as its error. Returns their final
        outputs; a second call returns nothing."""
        if self.failure is not None:
            return []
        self.failure = reason
        log.error("engine failed: open requests end with an error", actor=self.name, reason=reason,
                  open=self.frontend.num_unfinished)
        return self._send(self.frontend.fail_all(reason))

    def _check_not_failed(self) -> None:
        if self.failure is not None:
            raise EngineDeadError(f"the engine failed: {self.failure}")

    # ------------------------------------------------------------------ updates in
    def _receive(self, message: RequestUpdates) -> list[RequestOutput]:
        """The scheduler's updates through the frontend: the outputs they produce (and, for a
        stop string, the abort and the FINISHED event sent on)."""
        return self._send(self.frontend.handle(message))

    def _receive_any(self, message: RequestUpdates | ControlReply) -> list[RequestOutput]:
        """``_receive``, or an engine command's answer kept in ``control_replies``."""
        if isinstance(message, ControlReply):
            self.control_replies[message.control_id] = message
            return []
        return self._receive(message)

    def _receive_frame(self, payload: bytes) -> list[RequestOutput]:
        """``_receive_any`` for a wire frame; a frame of any other message is dropped."""
        message = self._decode_frame(payload)
        return self._receive_any(message) if message is not None else []

    def _decode_frame(self, payload: bytes) -> RequestUpdates | ControlReply | None:
        """The scheduler's updates, or the answer to an engine command; None for anything else."""
        try:
            message = self._codec.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            log.warning("frame dropped", actor=self.name, why="undecodable", error=str(error))
            return None
        if not isinstance(message, (RequestUpdates, ControlReply)):
            log.warning("frame dropped", actor=self.name, why="unexpected type", type=type(message).__name__)
            return None
        return message


class SyncClient(ClientCore, SyncEngineCommands, ABC):
    """A client whose calls return at once: what the offline ``LLM`` drives (with vLLM's engine
    commands: ``sleep``, ``wake_up``, ``is_sleeping``, ``reset_prefix_cache``)."""

    def submit(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request; its outputs come from ``poll``. Raises EngineDeadError once
        the engine has failed."""
        self._check_not_failed()
        self._submit(prepared)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self._abort(request_id, reason)

    @property
    def has_unfinished(self) -> bool:
        return self.frontend.num_unfinished > 0

    @abstractmethod
    def poll(self, timeout_ms: int = 100) -> list[RequestOutput]:
        """Wait up to ``timeout_ms`` for updates; return the outputs they produced (and first
        those ``control`` received while it waited)."""

    def control(self, action: str, timeout: float = CONTROL_TIMEOUT, **fields: Any) -> ControlReply:
        """An engine command (``AsyncEngineClient.control``'s actions and fields), sent and polled
        for until answered: a bad one is a ValueError, one the engine could not carry out a
        RuntimeError, no answer in ``timeout`` seconds a TimeoutError. Request outputs that come
        meanwhile are kept for the next ``poll``."""
        self._check_not_failed()
        control = new_control(action, **fields)
        self.transport.send(SCHEDULER, control)
        deadline = time.monotonic() + timeout
        while (reply := self.control_replies.pop(control.control_id, None)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine did not answer {action!r} within {timeout:.0f} s")
            self._held.extend(self.poll(100))
            self._check_not_failed()
        return checked_reply(reply)

    def _with_held(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """``outputs`` after those ``control`` received while it waited."""
        if not self._held:
            return outputs
        held, self._held = self._held, []
        return [*held, *outputs]

    @abstractmethod
    def query_metrics(self, query: MetricsQuery) -> MetricsReply:
        """One query to the metrics store."""

    def get_metrics(self, replica: int | None = None) -> SummaryReply:
        """Counters, gauges and latency percentiles from the metrics store: the whole group's, or
        (``replica``) one replica's."""
        return expect_reply(self.query_metrics(SummaryQuery(replica=replica)), SummaryReply)

    def get_timeline(self, request_id: str) -> TimelineReply:
        return expect_reply(self.query_metrics(TimelineQuery(request_id=request_id)), TimelineReply)

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the client holds (sockets); the engine itself is not stopped."""


def expect_reply(reply: MetricsReply, kind: type[R]) -> R:
    if not isinstance(reply, kind):
        raise RuntimeError(f"the metrics store answered {reply!r}")
    return reply


def frontend_for_group(info: GroupInfo, tokenizer: Tokenizer | None) -> Frontend:
    """The frontend state machine for a running group: model facts come from what its worker
    reported at start-up."""
    facts = info.worker
    return Frontend(
        tokenizer,
        list(cast("list[int]", facts.get("eos_token_ids", []))),
        info.max_model_len,
        int(cast(int, facts.get("vocab_size", 0))),
    )


def group_info_of(target: str | os.PathLike[str] | GroupInfo | None) -> GroupInfo:
    """The group to attach to: its ``GroupInfo``, its run directory, or (None) the newest running one."""
    from vllm_actors.runtime.run_dir import GroupInfo, find_running_group, read_group_info

    if isinstance(target, GroupInfo):
        return target
    return find_running_group() if target is None else read_group_info(Path(target))


def drop_work_events(info: GroupInfo) -> bool:
    """Whether a client of this group publishes no work events, as the group's actors do (the
    engine's ``disable_events``; its environment name is the deprecated alias)."""
    return info.disable_events or envs.VLLM_ACTORS_DISABLE_EVENTS


def load_group_tokenizer(info: GroupInfo) -> Tokenizer | None:
    """The tokenizer a group names in its GroupInfo (None when it skips tokenizer init)."""
    if info.tokenizer is None:
        return None
    from vllm_actors.actors.frontend.tokenizer import load_tokenizer

    return load_tokenizer(info.tokenizer)


def _log_send_failure(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("send to the scheduler failed", error=repr(future.exception()))
