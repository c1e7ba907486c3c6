"""Which client connection owns which request: request identity at the scheduler's socket.

Every client (the HTTP server, an ``LLM``, any process that reaches the socket) talks to the
scheduler through one DEALER connection; the shell knows each message's connection by its routing
id (``sender``). Request ids are namespaced per connection in the sense that every lookup a client
can cause is made within its own connection's ids:

* an ``AddRequest`` whose id another connection holds is refused, answered to the newcomer only
  (an error update under that id, sent to its sender alone) with a ``REJECTED`` event; the holder's
  request, its updates and its timeline are untouched. So is a plain (not ``resume``) duplicate
  from the holder itself: a client cannot restart or extend a request by re-sending its id;
* an ``AbortRequests`` aborts only the sender's own ids; the others are left out (logged,
  ``REJECTED``), so no client can end another's request; ``all_of_sender`` aborts every request
  the sender's connection owns (a client restarted under the routing id of its dead predecessor);
* updates go to the owning connection only (``split``); so does the answer to an engine command
  (``EngineControl``), to the connection that sent it (``control_owner``).

Why ownership over one id space rather than per-connection id spaces (``(connection, id)`` keys
rewritten to ``<connection>/<id>`` in the pipeline): the id the client chose stays the id in every
event, the metrics store's timelines, ``tap --request`` and ``stats --timeline``, and it stays
unique there, so a timeline is never two clients' requests mixed. The cost is that two connections
cannot use the same id at the same time: the second is refused, which is what a client that picks
unguessable ids (the server's ``cmpl-<random>``) never meets.

Restarts: a restarted scheduler starts with no owners. Each client re-sends its unfinished requests
(``AddRequest(resume=True)``) over its same connection (same routing id), which makes it their
owner again before anything else reaches them; a resubmission of an id the connection already holds
passes (the scheduler ignores it). A peer that knew another client's id and re-sent it first, in
the moment between the restart and that client's resubmission, would own it: the rightful client
then gets an error for it (never a hang). Ownership is as strong as the routing id: a peer that
connects under another's routing id takes over its connection (``ROUTER_HANDOVER``, which restarted
actors need); authenticating peers is the transport's part (CURVE on TCP, the 0700 run directory
for IPC).

A pure state machine: no sockets; ``sender`` is opaque bytes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from vllm_actors.protocol.messages import AbortRequests, AddRequest, EngineControl, RequestUpdate, RequestUpdates
from vllm_actors.protocol.names import describe_request_id, engine_request_id_error


@dataclass(frozen=True)
class Refusal:
    """Why (part of) a message was refused, and the answer its sender alone gets (None: none)."""

    error: str
    reply: RequestUpdates | None = None


def refused_request(request_id: str, error: str) -> RequestUpdates:
    """The answer to a refused ``AddRequest``: its id finished with ``error``."""
    update = RequestUpdate(request_id=request_id, finish_reason="error", error=error)
    return RequestUpdates(step_id=-1, updates=[update])


class RequestOwners:
    """The scheduler shell's map of request id -> owning connection, and the rules above."""

    def __init__(self) -> None:
        self._owner: dict[str, bytes] = {}
        self._control_owner: dict[str, bytes] = {}  # an engine command's id -> who sent it, until answered

    def owner(self, request_id: str) -> bytes | None:
        return self._owner.get(request_id)

    def __len__(self) -> int:
        return len(self._owner)

    def screen(self, sender: bytes, message: Any) -> tuple[Any | None, Refusal | None]:
        """Before the scheduler sees ``message``: what of it may go on (None: nothing), and the
        refusal of the rest (None: nothing refused). Changes nothing."""
        if isinstance(message, AddRequest):
            error = self._add_error(sender, message)
            if error is None:
                return message, None
            return None, Refusal(error, refused_request(message.request_id, error))
        if isinstance(message, AbortRequests) and message.all_of_sender:
            held = [request_id for request_id, owner in self._owner.items() if owner == sender]
            return (AbortRequests(request_ids=held, reason=message.reason) if held else None), None
        if isinstance(message, AbortRequests):
            own = [request_id for request_id in message.request_ids if self._owner.get(request_id) == sender]
            # Unknown ids are normal (the request finished while the abort was on its way) and
            # left out silently: only another connection's ids are refused.
            others = [request_id for request_id in message.request_ids
                      if self._owner.get(request_id, sender) != sender]
            refusal = None
            if others:
                shown = ", ".join(describe_request_id(request_id) for request_id in others[:3])
                more = f" and {len(others) - 3} more" if len(others) > 3 else ""
                refusal = Refusal(f"abort of another client's requests refused: {shown}{more}")
            if len(own) == len(message.request_ids):
                return message, refusal
            return (AbortRequests(request_ids=own, reason=message.reason) if own else None), refusal
        return message, None

    def _add_error(self, sender: bytes, message: AddRequest) -> str | None:
        error = engine_request_id_error(message.request_id)
        if error is not None:
            return error
        holder = self._owner.get(message.request_id)
        if holder is None or (holder == sender and message.resume):
            return None  # a new id, or a resubmission of the sender's own (the scheduler ignores it)
        whose = "another client's request" if holder != sender else "a request of this client in flight"
        return f"request_id {describe_request_id(message.request_id)} is already in use by {whose}"

    def observe(self, sender: bytes, message: Any) -> None:
        """After the scheduler took a screened message: record new owners, forget aborted ids."""
        if isinstance(message, AddRequest):
            self._owner.setdefault(message.request_id, sender)
        elif isinstance(message, EngineControl):
            self._control_owner[message.control_id] = sender
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                if self._owner.get(request_id) == sender:
                    del self._owner[request_id]

    def control_owner(self, control_id: str) -> bytes | None:
        """Who sent the engine command ``control_id`` (forgotten now: it is answered once)."""
        return self._control_owner.pop(control_id, None)

    def split(self, updates: RequestUpdates) -> dict[bytes, RequestUpdates]:
        """The scheduler's updates by owning connection; a finished request is forgotten."""
        grouped: dict[bytes, list[RequestUpdate]] = defaultdict(list)
        for update in updates.updates:
            owner = self._owner.get(update.request_id)
            if owner is None:
                continue
            grouped[owner].append(update)
            if update.finish_reason is not None:
                del self._owner[update.request_id]
        return {owner: RequestUpdates(step_id=updates.step_id, updates=batch, step_finished_at=updates.step_finished_at,
                                      sent_at=updates.sent_at)
                for owner, batch in grouped.items()}
