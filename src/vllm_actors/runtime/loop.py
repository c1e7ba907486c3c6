"""The actor loop's decisions, written once for both transports: check who may send what, screen
clients' request ids, handle, send the messages, publish the events.

``ActorLoop`` takes an ``Endpoint`` (the ZMQ shell's sockets or an in-memory endpoint) and a
``Publisher`` (the bus, or the in-process engine's listeners); the shells only decide when to look
for the next message. A message of a type the actor does not take, or from a sender that may not
send it, is logged and dropped; one the state machine rejects (``MessageRejected``: it failed
validation, nothing changed) likewise, with a ``REJECTED`` event. Where clients connect (the
scheduler, the controller) requests and aborts are screened first for request identity
(``actors/scheduler/owners.py``: each client connection owns its request ids; a refused
``AddRequest`` is answered to its sender only), and updates go to their owner only. Any other
exception out of the state machine is a bug and propagates.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

import structlog

from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.events import Rejected
from vllm_actors.protocol.messages import ControlReply, RequestUpdates, StepResult
from vllm_actors.protocol.names import FRONTEND
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.runtime.transport import Actor, Deferring, Endpoint

log = structlog.get_logger(__name__)

# Which senders may send which message type to an actor; None means any sender (clients).
AcceptRules = Mapping[type, frozenset[bytes] | None]


class Publisher(Protocol):
    def publish(self, events: list[Any]) -> object: ...


class ActorLoop:
    """One actor with its endpoint, its publisher and its rules. ``owners``: the request-identity
    screen, for an actor clients connect to (None: none). ``raise_rejections``: a rejection
    propagates instead of being dropped (the in-process engine, where it is a bug to see)."""

    def __init__(self, actor: Actor, endpoint: Endpoint, publisher: Publisher, accepts: AcceptRules, *,
                 owners: RequestOwners | None = None, raise_rejections: bool = False) -> None:
        self.actor = actor
        self.endpoint = endpoint
        self.publisher = publisher
        self.accepts = accepts
        self.owners = owners
        self.raise_rejections = raise_rejections
        self.deferring: Deferring | None = actor if isinstance(actor, Deferring) else None

    def has_pending(self) -> bool:
        """Whether the actor launched work it has not read back yet."""
        return self.deferring is not None and self.deferring.has_pending()

    def pending_ready(self) -> bool:
        return self.deferring is not None and self.deferring.pending_ready()

    def flush(self) -> Outputs:
        """Read the launched work back and send what it produced."""
        return self.dispatch(self.deferring.flush() if self.deferring is not None else Outputs())

    def receive(self, sender: bytes, message: Any) -> Outputs | None:
        """Accept, screen, handle and dispatch one message; returns what was sent (None: refused)."""
        kind = self.endpoint.codec.protocol_type(message)
        if kind not in self.accepts:
            self.endpoint.drop("message type not taken here", sender=sender, type=kind.__name__)
            return None
        allowed = self.accepts[kind]
        if allowed is not None and sender not in allowed:
            self.endpoint.drop("sender may not send this", sender=sender, type=kind.__name__)
            return None
        if self.owners is not None:
            message, refusal = self.owners.screen(sender, message)  # identity: ids owned per connection
            if refusal is not None:
                self.refuse(sender, kind.__name__, refusal.error, "refused: request identity", message)
                if refusal.reply is not None:
                    self.endpoint.send(sender, refusal.reply)  # to the sender only
            if message is None:
                return None
        try:
            outputs = self.actor.handle(message)
        except MessageRejected as error:  # anything else is a bug: it propagates, the actor crashes
            if self.raise_rejections:
                raise
            self.refuse(sender, kind.__name__, str(error), "rejected by the state machine", message)
            return None
        if self.owners is not None:
            self.owners.observe(sender, message)
        return self.dispatch(outputs)

    def refuse(self, sender: bytes, message_type: str, error: str, why: str, message: Any = None) -> None:
        """Log and publish (``REJECTED``) a message refused whole or in part; nothing changed."""
        self.endpoint.drop(why, sender=sender, type=message_type, error=error, **_request_of(message))
        self.publisher.publish(
            [Rejected(message_type=message_type, sender=sender[:64].decode(errors="replace"), error=error)]
        )

    def dispatch(self, outputs: Outputs) -> Outputs:
        """Send the messages (a client's updates, an engine command's answer, to their owner only),
        then publish the events."""
        for destination, message in outputs.messages:
            stamp_departure(message)
            if self.owners is not None and destination == FRONTEND and isinstance(message, RequestUpdates):
                for owner, updates in self.owners.split(message).items():
                    self.endpoint.send(owner, updates)
                continue
            if self.owners is not None and destination == FRONTEND and isinstance(message, ControlReply):
                asker = self.owners.control_owner(message.control_id)
                if asker is not None:  # an engine command's answer, to its sender only
                    self.endpoint.send(asker, message)
                continue
            try:
                self.endpoint.send(destination, message)
            except KeyError:
                log.error("no route", actor=self.endpoint.name, destination=destination)
        if outputs.events:
            self.publisher.publish(outputs.events)
        return outputs


def stamp_departure(message: Any) -> None:
    """A step result's and a scheduler's updates' departure time, once (a controller forwarding a
    replica's updates keeps the replica's): the edge stamps, the state machines hold no clock."""
    if isinstance(message, StepResult) and not message.finished_at:
        message.finished_at = time.monotonic()
    elif isinstance(message, RequestUpdates) and not message.sent_at:
        message.sent_at = time.monotonic()


def _request_of(message: Any) -> dict[str, object]:
    """The request id a message names, for its log line (none: no field)."""
    request_id = getattr(message, "request_id", None)
    if isinstance(request_id, str):
        return {"request_id": request_id}
    request_ids = getattr(message, "request_ids", None)
    return {"request_ids": request_ids[:8]} if isinstance(request_ids, list) and request_ids else {}
