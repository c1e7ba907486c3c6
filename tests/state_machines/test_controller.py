"""A replica set's controller, in process: it routes requests and passes updates back, recovers only
a restarted replica, reroutes a dead host's requests, resumes requests after its own restart (passing
each token once by its position), and hears its replicas' caches and the supervisor."""

from __future__ import annotations

import msgspec
import pytest

import vllm_actors.actors.controller.controller as controller_module
from tests.state_machines.test_routing import BLOCK, cached
from vllm_actors.actors.controller.controller import Controller, FromReplica
from vllm_actors.actors.controller.prefix_mirror import prompt_block_hashes
from vllm_actors.actors.controller.routing import Router
from vllm_actors.protocol.events import ActorFailed, ActorRestarted, ActorStarting, EventBatch, Routed
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    RecoverPipeline,
    ReplicaState,
    RequestUpdate,
    RequestUpdates,
)
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams


def add(request_id: str, tokens: list[int] | None = None, **fields: object) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=tokens or [1, 2, 3], params=SamplingParams(max_tokens=4),
                      eos_token_ids=[0], **fields)  # type: ignore[arg-type]


def updates(*items: RequestUpdate) -> RequestUpdates:
    return RequestUpdates(step_id=1, updates=list(items))


def test_the_controller_routes_passes_updates_back_and_recovers_only_the_restarted_replica() -> None:
    controller = Controller(Router("round_robin", 2))
    out = Outputs().extend(controller.handle(add("a"))).extend(controller.handle(add("b")))
    assert [(to, type(m).__name__) for to, m in out.messages] == [("scheduler@0", "AddRequest"),
                                                                  ("scheduler@1", "AddRequest")]
    assert [type(m).__name__ for m in out.events] == ["Routed", "Routed"]
    assert out.events[0] == Routed(request_id="a", replica=0, reason="round_robin")
    back = controller.handle(FromReplica(1, updates(RequestUpdate(request_id="b", new_token_ids=[5, 6]))))
    assert back == Outputs(messages=[("frontend", updates(RequestUpdate(request_id="b", new_token_ids=[5, 6])))])
    # replica 1's scheduler restarted: only its request goes to it again, with its tokens so far
    resent = controller.handle(RecoverPipeline(actor="scheduler@1", reason="restarted"))
    assert len(resent.messages) == 1 and not resent.events and resent.messages[0][0] == "scheduler@1"
    (_, again), = resent.messages
    assert again.resume and again.output_token_ids == [5, 6] and again.request_id == "b"
    # a finished request is forgotten; aborts go where the request is
    controller.handle(FromReplica(0, updates(RequestUpdate(request_id="a", new_token_ids=[1], finish_reason="length"))))
    assert controller.handle(AbortRequests(request_ids=["a", "b"])) == Outputs(messages=[
        ("scheduler@1", AbortRequests(request_ids=["b"]))])
    assert not controller.requests


def test_a_replica_whose_host_died_has_its_requests_rerouted_and_gets_new_ones_once_back() -> None:
    controller = Controller(Router("round_robin", 2))
    for request_id in ("a", "b", "c", "d"):  # a, c on replica 0; b, d on replica 1
        controller.handle(add(request_id))
    controller.handle(FromReplica(1, updates(RequestUpdate(request_id="b", new_token_ids=[5, 6]))))
    # replica 1's host died (Ray's): b and d go to replica 0, resumed from the tokens forwarded
    out = controller.handle(ReplicaState(replica=1, up=False, reason="its host died"))
    sent = [(to, m) for to, m in out.messages if isinstance(m, AddRequest)]
    assert [(to, m.request_id, m.resume, m.output_token_ids) for to, m in sent] == [
        ("scheduler@0", "b", True, [5, 6]), ("scheduler@0", "d", True, [])]
    assert [m for m in out.events if isinstance(m, Routed)] == [
        Routed(request_id=request_id, replica=0, reason="rerouted") for request_id in ("b", "d")]
    assert controller.router.replicas[0].in_flight == 4 and controller.router.replicas[1].in_flight == 0
    # while it is down it gets nothing new; its updates now come from replica 0
    e, f = controller.handle(add("e")), controller.handle(add("f"))
    assert {to for to, _ in e.messages + f.messages} == {"scheduler@0"} and e.events and f.events
    back = controller.handle(FromReplica(0, updates(RequestUpdate(request_id="b", new_token_ids=[7]))))
    assert back == Outputs(messages=[("frontend", updates(RequestUpdate(request_id="b", new_token_ids=[7])))])
    # back (Ray restarted the host): it takes requests again; nothing of the old copies is resent
    assert controller.handle(ReplicaState(replica=1, up=True)) == Outputs()
    g, h = controller.handle(add("g")), controller.handle(add("h"))
    assert {to for to, _ in g.messages + h.messages} >= {"scheduler@1"}


def test_with_no_replica_left_up_the_requests_wait_for_their_host_to_come_back() -> None:
    controller = Controller(Router("round_robin", 2))
    controller.handle(add("a"))
    controller.handle(add("b"))
    assert controller.handle(ReplicaState(replica=0, up=False)) == Outputs(
        messages=[("scheduler@1", msgspec.structs.replace(add("a"), resume=True))],
        events=[Routed(request_id="a", replica=1, reason="rerouted")])
    assert controller.handle(ReplicaState(replica=1, up=False)) == Outputs()  # nowhere to go: both stay on 1
    resent = controller.handle(ReplicaState(replica=1, up=True))
    assert not resent.events
    assert [(to, m.request_id, m.resume) for to, m in resent.messages] == [
        ("scheduler@1", "a", True), ("scheduler@1", "b", True)]


def test_after_a_controller_restart_a_request_still_running_somewhere_resumes_on_another_replica(
        monkeypatch: pytest.MonkeyPatch) -> None:
    controller = Controller(Router("round_robin", 2))  # a new incarnation: knows nothing
    # replica 0 still runs "a" (its update reaches us before the client re-sends it): dropped, remembered
    assert controller.handle(FromReplica(0, updates(RequestUpdate(request_id="a", new_token_ids=[9])))) == Outputs()
    out = controller.handle(add("a", resume=True, output_token_ids=[4, 5]))
    assert out.messages[0] == ("scheduler@0", AbortRequests(request_ids=["a"], reason="rerouted"))
    assert out.messages[1][0] == "scheduler@1" and out.messages[1][1].output_token_ids == [4, 5]
    assert out.events[0] == Routed(request_id="a", replica=1, reason="resumed")
    # one not heard of since the restart is routed as new
    assert controller.handle(add("b", resume=True, output_token_ids=[1])).messages[0][0] == "scheduler@0"
    # what it remembers is bounded: the oldest go first
    monkeypatch.setattr(controller_module, "MAX_UNCLAIMED", 2)
    for name in ("x", "y", "z"):
        controller.handle(FromReplica(1, updates(RequestUpdate(request_id=name, new_token_ids=[1]))))
    assert list(controller.unclaimed) == ["y", "z"]


def test_updates_from_a_replica_that_does_not_hold_the_request_are_dropped_and_it_is_aborted_there() -> None:
    controller = Controller(Router("round_robin", 2))
    controller.handle(add("a"))  # on replica 0
    out = controller.handle(FromReplica(1, updates(RequestUpdate(request_id="a", new_token_ids=[9]),
                                                   RequestUpdate(request_id="zz", new_token_ids=[9]))))
    # "zz": nobody's
    assert out == Outputs(messages=[("scheduler@1", AbortRequests(request_ids=["a"], reason="rerouted"))])
    assert controller.requests["a"].output_token_ids == []


def test_a_waiting_request_aborted_in_the_controller_is_reported_there() -> None:
    controller = Controller(Router("pull", 1, capacity=1))
    controller.handle(add("a"))
    assert controller.handle(add("b")) == Outputs()  # no room: it waits
    out = controller.handle(AbortRequests(request_ids=["b"], reason="disconnect"))
    assert not out.messages and [type(m).__name__ for m in out.events] == ["Aborted"]
    freed = controller.handle(FromReplica(0, updates(RequestUpdate(request_id="a", finish_reason="stop"))))
    assert [to for to, _ in freed.messages] == ["frontend"] and not freed.events  # nothing left waiting


def test_the_controller_hears_its_replicas_caches_and_the_supervisor() -> None:
    controller = Controller(Router("cache_aware", 2, block_size=BLOCK))
    tenant = list(range(100, 116))
    batch = EventBatch(actor="kv_cache_manager@1", first_seq=0, mono=0, wall=0, events=[cached(tenant, 4)])
    controller.observe("kv_cache_manager@0", batch)  # not under its own topic: ignored
    assert controller.router.replicas[1].mirror.match(prompt_block_hashes(tenant, BLOCK)) == 0
    controller.observe("kv_cache_manager@1", batch)
    assert controller.handle(add("a", tenant + [1])).messages[0][0] == "scheduler@1"
    forged = EventBatch(actor="worker-0@1", first_seq=0, mono=0, wall=0, events=[cached(list(range(16)), 4)])
    controller.observe("worker-0@1", forged)  # only the KV-cache managers' blocks count
    assert controller.router.replicas[1].mirror.match(prompt_block_hashes(list(range(16)), BLOCK)) == 0
    supervisor = EventBatch(actor="supervisor", first_seq=0, mono=0, wall=0,
                            events=[ActorFailed(actor="worker-0@1", how="exited", detail="killed by SIGKILL")])
    controller.observe("supervisor", supervisor)
    assert controller.handle(add("b", tenant + [2])).messages[0][0] == "scheduler@0"  # replica 1 is down
    back = EventBatch(actor="supervisor", first_seq=1, mono=0, wall=0,
                      events=[ActorRestarted(actor="worker-0@1", pid=1, attempt=1, seconds=1.0)])
    controller.observe("supervisor", back)
    restarted = EventBatch(actor="kv_cache_manager@1", first_seq=0, mono=0, wall=0,
                           events=[ActorStarting(pid=2, role="x")])
    controller.observe("kv_cache_manager@1", restarted)  # a fresh pool: nothing cached
    assert controller.router.replicas[1].up and len(controller.router.replicas[1].mirror) == 0


def test_after_a_controller_restart_a_resubmission_routed_to_its_own_replica_loses_no_token() -> None:
    """The known gap, closed: the client re-sends "b" (it has [1]) before any update of b reaches the
    new controller, and the route picks the replica that still runs it. That replica's scheduler
    answers with the tokens the client lacks from where its own end (catch_up), and the controller
    passes each token once by its position, whichever of the catch-up and the replica's next update
    comes first."""
    from vllm_actors.actors.scheduler.recovery import catch_up
    from vllm_actors.actors.scheduler.request import ScheduledRequest

    held = ScheduledRequest(request_id="b", prompt_token_ids=[3, 4], params=add("b").params, eos_token_ids=[0],
                            packed_prompt=b"", output_token_ids=[1, 2, 3])  # 2, 3 went to the dead controller
    resent = add("b", resume=True, output_token_ids=[1])
    [(to, reply)] = catch_up(held, resent)
    assert to == "frontend" and reply.updates[0].new_token_ids == [2, 3] and reply.updates[0].output_index == 1
    assert catch_up(held, add("b", resume=True, output_token_ids=[1, 2, 3])) == []  # nothing missing
    assert catch_up(held, add("b", resume=True, output_token_ids=[7])) == []  # not this copy's history

    def fresh() -> Controller:
        controller = Controller(Router("round_robin", 2))  # a new incarnation: knows nothing
        assert controller.handle(resent).messages[0] == ("scheduler@0", resent)  # to its own replica, by chance
        return controller

    def passed(out: Outputs) -> list[int]:
        return [t for _, m in out.messages if isinstance(m, RequestUpdates) for u in m.updates for t in u.new_token_ids]

    next_update = updates(RequestUpdate(request_id="b", new_token_ids=[4], output_index=3))
    # the catch-up first, then the next token
    controller = fresh()
    tokens = passed(controller.handle(FromReplica(0, reply))) + passed(controller.handle(FromReplica(0, next_update)))
    assert tokens == [2, 3, 4] and controller.requests["b"].output_token_ids == [1, 2, 3, 4]
    # the replica's next update crossed the resubmission: held back (past what was forwarded),
    # then the catch-up brings everything once
    controller = fresh()
    assert passed(controller.handle(FromReplica(0, next_update))) == [] and controller.num_gapped == 1
    caught_up = updates(RequestUpdate(request_id="b", new_token_ids=[2, 3, 4], output_index=1))
    assert passed(controller.handle(FromReplica(0, caught_up))) == [2, 3, 4]
    # an update overlapping what was forwarded passes only its new tokens
    assert passed(controller.handle(FromReplica(0, updates(
        RequestUpdate(request_id="b", new_token_ids=[4, 5], output_index=3))))) == [5]
    assert controller.requests["b"].output_token_ids == [1, 2, 3, 4, 5]
