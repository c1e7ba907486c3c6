"""The replica-set controller: the clients' entry point when ``data_parallel_size > 1``.

Clients talk to it exactly as to one scheduler (``AddRequest``, ``AbortRequests`` in;
``RequestUpdates`` out, through the same socket rules: ``actors/scheduler/owners.py`` applies at
its socket). It sends each new request to one replica's scheduler (``routing.Router``), passes
aborts to the replica holding the request, and passes the replicas' updates back. It keeps what
it needs to recover a replica's requests without their clients: each open request's
``AddRequest`` and the output tokens it forwarded. When the supervisor reports that a replica's
scheduler restarted (``RecoverPipeline`` naming it), the controller sends that replica every
request it held again (``resume=True`` with the tokens so far), as a client does after a
single scheduler's restart; the other replicas' requests never notice.

It also follows the bus (the shell feeds ``observe``): the replicas' KV-cache managers' block and
pool events (the cache-aware mirror, the KV usage) and the supervisor's failures and restarts (a
replica with an actor down gets no new request while another is up). An update for a request the
controller does not hold from that replica (a controller restarted and routed the client's
resubmission elsewhere) is not forwarded, and the request is aborted there; an update for a
request it does not hold at all is dropped.

When the controller itself restarts, its clients re-send their open requests (``resume=True``).
A replica still running one has sent its updates to the dead controller (lost); once one of its
updates reaches the new controller, the request is known to run there ("unclaimed"), and its
re-sent copy goes to another replica, resuming from the client's tokens, while the old copy is
aborted (never aborted and re-added on one replica: a scheduler must not see an id leave and come
back while a step of it is in flight). A request re-sent before its replica's next update arrives
is routed as new; if that is its own replica, its scheduler answers with the tokens the client
lacks, from where the client's end (``recovery.catch_up``), and the controller passes each token
once by its position (``RequestUpdate.output_index``, ``in_place``): an update that starts past
what it forwarded is held back, the catch-up brings its tokens.

With a ``LoanPlanner`` (``kv_loans``), a request too long for some replica's pool is placed on a
home replica with blocks borrowed from lenders (``placement``; ``borrowing.Borrowing``: the loans'
messages); it waits here until every lender confirmed, and one that fits nowhere, even borrowing, is
refused here.
A restarted lender's scheduler is asked for its loans again. ``build_controller`` gives it a
planner with ``kv_borrowing`` only.

A pure state machine: no sockets, no clock. Replicas are addressed by their scheduler's name
(``scheduler@<r>``); ``Routed`` events say where each request went.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_actors.actors.controller.borrowing import Borrowing
from vllm_actors.actors.controller.kv_loans import LoanPlanner
from vllm_actors.actors.controller.placement import OpenRequest, Placement
from vllm_actors.actors.controller.routing import Router, RouteRequest
from vllm_actors.protocol.events import (
    Aborted,
    ActorFailed,
    ActorRestarted,
    ActorStarting,
    EventBatch,
    KvLent,
    Routed,
)
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    RecoverPipeline,
    ReplicaState,
    RequestUpdate,
    RequestUpdates,
    without_delivered,
)
from vllm_actors.protocol.names import (
    CONTROLLER,
    FRONTEND,
    KV_CACHE_MANAGER,
    SCHEDULER,
    SUPERVISOR,
    replica_actor,
    split_replica,
)
from vllm_actors.protocol.outputs import Outputs

MAX_SESSION_KEY = 256  # characters of a session key kept as they are; a longer one is digested
MAX_ABORT_REASON = 64
MAX_UNCLAIMED = 65_536


@dataclass(frozen=True)
class FromReplica:
    """Updates as the shell hands them over: with the replica whose scheduler sent them."""

    replica: int
    updates: RequestUpdates


def in_place(update: RequestUpdate, forwarded: int) -> RequestUpdate | None:
    """The update with the tokens already forwarded (``forwarded`` of them) left out, by its
    ``output_index``; None when it starts past them (a gap: after a restart of ours, the replica's
    catch-up for the client's resubmission is still on its way and brings these tokens too; its
    finish, if any, comes again with the resumed copy). Unpositioned updates pass as they are."""
    if update.output_index > forwarded:
        return None
    return without_delivered(update, forwarded)


def _resumed(request_id: str, request: OpenRequest) -> AddRequest:
    """The request as sent again after its copy was lost: resumed from the tokens forwarded so far."""
    return msgspec.structs.replace(request.add, request_id=request_id, resume=True,
                                   output_token_ids=list(request.output_token_ids))


def session_key(key: str | None) -> str | None:
    if key is None or len(key) <= MAX_SESSION_KEY:
        return key
    return "#" + hashlib.blake2b(key.encode(), digest_size=16).hexdigest()


class Controller(Placement):
    name = CONTROLLER

    def __init__(self, router: Router, loans: LoanPlanner | None = None) -> None:
        """``loans``: place requests too long for a replica's pool with KV borrowed from others
        (``kv_loans``); None: every request goes where the router sends it."""
        self.router = router
        self.loans = loans
        self.num_replicas = len(router.replicas)
        self.requests: dict[str, OpenRequest] = {}
        self._down: dict[int, set[str]] = defaultdict(set)  # replica -> its actors reported down
        self.hosts_down: set[int] = set()  # replicas whose whole host is gone (Ray-placed replicas)
        self.num_rerouted = 0  # requests moved off a replica whose host went down
        self.num_orphans = 0
        self.num_gapped = 0  # updates held back: they started past the tokens forwarded (in_place)
        # requests a replica runs that nobody here routed (a restart of ours): id -> replica
        self.unclaimed: OrderedDict[str, int] = OrderedDict()
        self.borrowing = Borrowing(loans, self.scheduler_of) if loans is not None else None

    @property
    def held(self) -> dict[str, set[int]]:
        """Borrowing requests waiting here -> their lenders whose KV_LENT has not come yet."""
        return self.borrowing.held if self.borrowing is not None else {}

    def scheduler_of(self, replica: int) -> str:
        return replica_actor(SCHEDULER, replica)

    # ------------------------------------------------------------------ messages
    def handle(self, message: Any) -> Outputs:
        if isinstance(message, AddRequest):
            return self._add(message)
        if isinstance(message, AbortRequests):
            return self._abort(message)
        if isinstance(message, FromReplica):
            return self._updates(message.replica, message.updates)
        if isinstance(message, RecoverPipeline):
            return self._recover(message)
        if isinstance(message, ReplicaState):
            return self._replica_state(message)
        raise TypeError(f"the controller does not take {type(message).__name__}")

    def _add(self, add: AddRequest) -> Outputs:
        outputs = Outputs()
        known = self.requests.get(add.request_id)
        if known is not None:  # a resubmission of a request in hand: where it is (the replica ignores it)
            if known.replica is not None:
                outputs.send(self.scheduler_of(known.replica), add)
            return outputs
        holder = self.unclaimed.pop(add.request_id, None) if add.resume else None
        if holder is not None and self.num_replicas > 1:
            # Re-sent after a restart of ours while a replica still runs it: the tokens that copy
            # made while no controller listened are lost, so a fresh copy on another replica
            # resumes from the client's tokens and the old one is stopped.
            self.requests[add.request_id] = OpenRequest(add, None, list(add.output_token_ids))
            replica = min((r for r in range(self.num_replicas) if r != holder),
                          key=lambda r: (self.router.replicas[r].in_flight, r))
            self.router.replicas[replica].in_flight += 1
            outputs.send(self.scheduler_of(holder), AbortRequests(request_ids=[add.request_id], reason="rerouted"))
            return outputs.extend(self._send(add.request_id, replica, "resumed", 0))
        key = session_key(add.session_key)
        self.requests[add.request_id] = OpenRequest(add, None, list(add.output_token_ids))
        if self.loans is not None:
            placed = self._place(add)
            if placed is not None:
                return placed
        # a malformed packed prompt is routed unread: the replica's scheduler refuses it, saying why
        prompt = add.prompt_ids() if add.prompt_form_error() is None else []
        decision = self.router.route(RouteRequest(add.request_id, prompt, key))
        if decision is None:
            return outputs  # pull: waits for a replica with room
        return self._send(add.request_id, decision.replica, decision.reason, decision.cached_blocks)

    def _abort(self, message: AbortRequests) -> Outputs:
        per_replica: dict[int, list[str]] = defaultdict(list)
        out = Outputs()
        for request_id in message.request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue  # finished meanwhile
            if request.replica is None:  # never left the controller
                self.router.drop(request_id)
                out += self._loans_back(request_id)
                if message.reason != "stop":
                    out.emit(Aborted(request_id=request_id, reason=message.reason[:MAX_ABORT_REASON],
                                     num_output_tokens=len(request.output_token_ids)))
                continue
            per_replica[request.replica].append(request_id)
            out += self._loans_back(request_id)
        for replica, ids in per_replica.items():
            out.messages.insert(0, (self.scheduler_of(replica), AbortRequests(request_ids=ids, reason=message.reason)))
            for _ in ids:
                out += self._released(replica)
        return out

    def _updates(self, replica: int, updates: RequestUpdates) -> Outputs:
        passed: list[RequestUpdate] = []
        orphans: list[str] = []
        out = Outputs()
        for update in updates.updates:
            request = self.requests.get(update.request_id)
            if request is None:
                # aborted or finished here (late updates), or running since before a restart of
                # ours: remember where, for when its client re-sends it
                if update.finish_reason is None:
                    self.unclaimed[update.request_id] = replica
                    self.unclaimed.move_to_end(update.request_id)
                    if len(self.unclaimed) > MAX_UNCLAIMED:  # late updates of aborted requests: the oldest go
                        self.unclaimed.popitem(last=False)
                else:
                    self.unclaimed.pop(update.request_id, None)
                continue
            if request.replica != replica:
                # Another replica serves it now (routed again after a restart of ours): stop this
                # copy. Never an abort of a request coming back to the same replica: a scheduler
                # must not see one id leave and return while a step of it is in flight.
                if update.finish_reason is None:
                    orphans.append(update.request_id)
                continue
            placed = in_place(update, len(request.output_token_ids))
            if placed is None:
                self.num_gapped += 1
                continue
            passed.append(placed)
            request.output_token_ids.extend(placed.new_token_ids)
            if placed.finish_reason is not None:
                del self.requests[placed.request_id]
                out += self._loans_back(placed.request_id)
                out += self._released(replica)
        if passed:
            out.messages.insert(0, (FRONTEND, RequestUpdates(step_id=updates.step_id, updates=passed,
                                                             step_finished_at=updates.step_finished_at,
                                                             sent_at=updates.sent_at)))
        if orphans:
            self.num_orphans += len(orphans)
            out.send(self.scheduler_of(replica), AbortRequests(request_ids=orphans, reason="rerouted"))
        return out

    def _recover(self, message: RecoverPipeline) -> Outputs:
        """A replica's scheduler restarted: its requests go to it again, resumed with their tokens."""
        out = Outputs()
        name, replica = split_replica(message.actor)
        if name != SCHEDULER or replica is None or replica >= self.num_replicas:
            return out
        for request_id, request in self.requests.items():
            if request.replica == replica:
                borrowing = self.borrowing.borrowing_of(request_id, replica) if self.borrowing is not None else None
                if borrowing is not None:
                    out.send(self.scheduler_of(replica), borrowing)
                out.send(self.scheduler_of(replica), _resumed(request_id, request))
        if self.borrowing is not None:  # the loans it had granted died with it: asked for again
            out += self.borrowing.lend_again(replica)
        return out

    def _replica_state(self, message: ReplicaState) -> Outputs:
        """A Ray-placed replica's host went down or came back (from the launcher).

        Down: it gets no new request, and each of its open requests goes to the least loaded
        replica still up, resumed from the tokens already forwarded (its old copy died with the
        host). With no replica up they stay where they are. Up (a fresh process group, nothing of
        the old one left): it takes requests again, and those that stayed on it are sent to it
        again, resumed."""
        replica = message.replica
        if not 0 <= replica < self.num_replicas:
            return Outputs()
        if message.up:
            self.hosts_down.discard(replica)
            self.router.set_up(replica, not self._down[replica])
            self.router.pool_lost(replica)
            return self._recover(RecoverPipeline(actor=self.scheduler_of(replica), reason="host restarted"))
        self.hosts_down.add(replica)
        self.router.set_up(replica, False)
        self.router.pool_lost(replica)
        others = [r for r in range(self.num_replicas) if r not in self.hosts_down and r != replica]
        out = Outputs()
        if not others:
            return out
        views = self.router.replicas
        for request_id, request in list(self.requests.items()):
            if request.replica != replica:
                continue
            target = min(others, key=lambda r: (views[r].in_flight, r))
            views[replica].in_flight = max(views[replica].in_flight - 1, 0)
            views[target].in_flight += 1
            request.replica = target
            self.num_rerouted += 1
            out.send(self.scheduler_of(target), _resumed(request_id, request))
            out.emit(Routed(request_id=request_id, replica=target, reason="rerouted", num_cached_blocks=0))
        return out

    # ------------------------------------------------------------------ the bus
    def observe(self, topic: str, batch: EventBatch) -> Outputs:
        """One batch off the bus: a replica's KV-cache manager's (its cache and pool) or the
        supervisor's (failures, restarts). Anything else, or a batch not under its own topic, is
        ignored. Returns what it releases: a borrowing request whose loans are all confirmed."""
        out = Outputs()
        if batch.actor != topic:
            return out
        if topic == SUPERVISOR:
            for event in batch.events:
                if isinstance(event, (ActorFailed, ActorRestarted)):
                    self._supervision(event)
            return out
        name, replica = split_replica(topic)
        if name != KV_CACHE_MANAGER or replica is None or replica >= self.num_replicas:
            return out
        for event in batch.events:
            if isinstance(event, ActorStarting):
                self.router.pool_lost(replica)  # a fresh pool (a restart): nothing cached
                if self.loans is not None:
                    self.loans.pool_lost(replica)
            else:
                self.router.observe(replica, event)
                if self.loans is not None:
                    self.loans.observe(replica, event)
                if isinstance(event, KvLent):
                    out += self._lent(replica, event.request_id)
        return out

    def _supervision(self, event: ActorFailed | ActorRestarted) -> None:
        _, replica = split_replica(event.actor)
        if replica is None or replica >= self.num_replicas:
            return
        down = self._down[replica]
        if isinstance(event, ActorFailed):
            down.add(event.actor)
        else:
            down.discard(event.actor)
        self.router.set_up(replica, not down and replica not in self.hosts_down)

