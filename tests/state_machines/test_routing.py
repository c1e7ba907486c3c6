"""Replica sets, in process: the routing policies (pure), the prefix-cache mirror, the controller's
state machine, replica names on the bus and in the metrics store."""

from __future__ import annotations

import msgspec
import pytest

import vllm_actors.actors.controller.controller as controller_module
from vllm_actors.actors.controller.controller import Controller, FromReplica
from vllm_actors.actors.controller.prefix_mirror import PrefixMirror, prompt_block_hashes
from vllm_actors.actors.controller.routing import Router, RouteRequest
from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.clients.supervision import classify
from vllm_actors.observe.tap_format import TapFilter
from vllm_actors.protocol.block_hash import block_hash
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import (
    ActorFailed,
    ActorRestarted,
    ActorStarting,
    Arrived,
    BlockCached,
    BlockEvicted,
    EventBatch,
    Finished,
    KvPool,
    Queued,
    Routed,
)
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    RecoverPipeline,
    ReplicaState,
    RequestUpdate,
    RequestUpdates,
)
from vllm_actors.protocol.names import is_engine_actor, replica_actor, replica_of, split_replica
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runtime.bus import topic_allowed
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.run_dir import make_addresses
from vllm_actors.runtime.supervisor import replica_environment

BLOCK = 4


def request(request_id: str, tokens: list[int] | None = None, key: str | None = None) -> RouteRequest:
    return RouteRequest(request_id, tokens if tokens is not None else [1, 2, 3], key)


def cached(tokens: list[int], blocks: int) -> BlockCached:
    hashes = prompt_block_hashes(tokens, BLOCK)[:blocks]
    return BlockCached(request_id="x", parent_hash=0, block_ids=list(range(len(hashes))), block_hashes=hashes)


# --------------------------------------------------------------------------- names
def test_replica_names_carry_their_replica_and_stay_engine_actors() -> None:
    assert replica_actor("scheduler", 1) == "scheduler@1" and replica_actor("worker-0", None) == "worker-0"
    assert split_replica("worker-0@12") == ("worker-0", 12)
    assert replica_of("kv_cache_manager@3") == 3 and replica_of("scheduler") == 0
    assert replica_of("controller") is None and replica_of("frontend-1") is None and replica_of("frontend-x@1") is None
    for actor in ("scheduler@1", "worker-0@1", "kv_cache_manager@0", "controller", "worker-3@bad"):
        assert is_engine_actor(actor), actor
        assert not topic_allowed(None, actor.encode()), actor  # a client can publish under none of them
    assert not is_engine_actor("frontend-1@2")
    assert topic_allowed("scheduler@1", b"scheduler@1") and not topic_allowed("scheduler@1", b"scheduler@0")


def test_a_replica_sets_addresses_give_each_replica_its_own_pipeline(tmp_path) -> None:
    addresses = make_addresses(tmp_path, 1, num_replicas=2)
    assert [r.scheduler for r in addresses.replicas] == [f"ipc://{tmp_path}/scheduler@0", f"ipc://{tmp_path}/scheduler@1"]
    assert addresses.scheduler == f"ipc://{tmp_path}/scheduler"  # the controller: the clients' entry point
    one = addresses.for_replica(1)
    assert one.kv_cache_manager.endswith("kv_cache_manager@1") and one.workers[0].endswith("worker-0@1")
    assert {"controller", "scheduler@1", "worker-0@1", "kv_cache_manager@0"} <= set(addresses.bus_in_actors)
    single = make_addresses(tmp_path, 1)
    assert single.scheduler.endswith("/scheduler") and not single.replicas and "controller" not in single.bus_in_actors


def test_each_replicas_worker_sees_its_own_gpus(tmp_path) -> None:
    config = EngineConfig(model="m", data_parallel_size=2)
    spec = ActorSpec(role="worker", actor_id="worker-0@1", addresses=make_addresses(tmp_path, 1, num_replicas=2),
                     engine=config, replica=1)
    assert replica_environment(spec, {"CUDA_VISIBLE_DEVICES": "4,5"})["CUDA_VISIBLE_DEVICES"] == "5"
    assert replica_environment(spec, {})["CUDA_VISIBLE_DEVICES"] == "1"
    assert replica_environment(spec, {"CUDA_VISIBLE_DEVICES": "0"}) is None  # fewer devices: left as it is
    assert replica_environment(ActorSpec(role="worker", actor_id="worker-0", addresses=spec.addresses, engine=config),
                               {}) is None


def test_config_checks_the_replica_arguments() -> None:
    with pytest.raises(ValueError, match="data_parallel_size"):
        EngineConfig(model="m", data_parallel_size=0)
    with pytest.raises(ValueError, match="routing_policy"):
        EngineConfig(model="m", routing_policy="random")
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig(model="m", data_parallel_size=2, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="data_parallel_size > 1"):
        EngineConfig(model="m", distributed_executor_backend="ray")
    assert EngineConfig(model="m", data_parallel_size=2, distributed_executor_backend="ray").data_parallel_size == 2


# --------------------------------------------------------------------------- policies
def test_round_robin_takes_replicas_in_turn_and_skips_one_that_is_down() -> None:
    router = Router("round_robin", 3)
    assert [router.route(request(str(i))).replica for i in range(4)] == [0, 1, 2, 0]  # type: ignore[union-attr]
    router.set_up(1, False)
    assert [router.route(request(str(i))).replica for i in range(3)] == [2, 0, 2]  # type: ignore[union-attr]


def test_least_loaded_takes_the_replica_with_fewest_requests_then_the_emptier_pool() -> None:
    router = Router("least_loaded", 2)
    assert router.route(request("a")).replica == 0  # type: ignore[union-attr]
    assert router.route(request("b")).replica == 1  # type: ignore[union-attr]
    assert router.route(request("c")).replica == 0  # type: ignore[union-attr]
    router.release(0)
    router.release(0)  # replica 0 is empty now, replica 1 holds one
    assert router.route(request("d")).replica == 0  # type: ignore[union-attr]
    router.observe(0, KvPool(num_blocks=100, num_free=10, num_cached=0, num_cached_idle=0, num_in_use=90))
    router.release(0)  # both empty: the pool decides
    router.release(1)
    assert router.route(request("e")).replica == 1  # type: ignore[union-attr]


def test_pull_holds_requests_until_a_replica_has_room_and_gives_the_oldest_to_the_one_that_freed() -> None:
    router = Router("pull", 2, capacity=1)
    first, second = router.route(request("a")), router.route(request("b"))
    assert (first.replica, second.replica, first.reason) == (0, 1, "pull")  # type: ignore[union-attr]
    assert router.route(request("c")) is None and router.route(request("d")) is None  # both full: they wait
    assert list(router.held) == ["c", "d"]
    dispatched = router.release(1)  # replica 1 has room: it takes the oldest
    assert [(r.request_id, d.replica, d.reason) for r, d in dispatched] == [("c", 1, "pulled")]
    assert router.drop("d") and router.release(0) == []  # aborted while waiting: nothing left to pull
    assert [view.in_flight for view in router.replicas] == [0, 1]


def test_cache_aware_follows_the_mirrored_prefix_and_falls_back_to_load() -> None:
    router = Router("cache_aware", 2, block_size=BLOCK)
    tenant = list(range(100, 116))  # four full blocks
    router.observe(1, cached(tenant, 4))
    decision = router.route(request("a", tenant + [7]))
    assert (decision.replica, decision.reason, decision.cached_blocks) == (1, "cache_hit", 4)  # type: ignore[union-attr]
    assert router.route(request("b", tenant + [8])).replica == 1  # type: ignore[union-attr]
    # a prefix nobody holds goes to the least loaded replica
    other = router.route(request("c", list(range(500, 516))))
    assert (other.replica, other.reason) == (0, "cache_aware")  # type: ignore[union-attr]
    # a cached run too short for the prompt does not pull it over
    short = router.route(request("d", tenant[:4] + list(range(900, 920))))
    assert short.reason == "cache_aware"  # type: ignore[union-attr]
    # evicted blocks are gone from the mirror
    hashes = prompt_block_hashes(tenant, BLOCK)
    router.observe(1, BlockEvicted(block_ids=[2, 3], block_hashes=hashes[2:], parent_hashes=hashes[1:3]))
    assert router.replicas[1].mirror.match(hashes) == 2
    router.pool_lost(1)
    assert router.replicas[1].mirror.match(hashes) == 0


def test_cache_aware_balances_a_replica_that_is_far_ahead() -> None:
    router = Router("cache_aware", 2, block_size=BLOCK, balance_abs_threshold=2, balance_rel_threshold=1.5)
    tenant = list(range(100, 116))
    router.observe(1, cached(tenant, 4))
    assert [router.route(request(str(i), tenant)).replica for i in range(3)] == [1, 1, 1]  # type: ignore[union-attr]
    decision = router.route(request("x", tenant))  # 3 against 0: past both thresholds
    assert (decision.replica, decision.reason) == (0, "cache_aware")  # type: ignore[union-attr]


def test_sticky_sessions_stay_on_their_replica_over_any_policy() -> None:
    router = Router("round_robin", 2)
    first = router.route(request("a", key="alice"))
    assert [router.route(request(str(i), key="alice")).replica for i in range(3)] == [first.replica] * 3  # type: ignore[union-attr]
    assert router.route(request("b", key="bob")).reason == "round_robin"  # type: ignore[union-attr]
    router.set_up(first.replica, False)  # type: ignore[union-attr]
    moved = router.route(request("c", key="alice"))
    assert moved.replica != first.replica and moved.reason == "round_robin"  # type: ignore[union-attr]
    bounded = Router("least_loaded", 2, max_sessions=2)
    for key in ("k1", "k2", "k3"):
        bounded.route(request(key, key=key))
    assert list(bounded.sessions) == ["k2", "k3"]


def test_the_mirror_hashes_blocks_as_the_prefix_cache_names_them() -> None:
    tokens = list(range(10))
    first = block_hash(0, tokens[0:4])
    assert prompt_block_hashes(tokens, 4) == [first, block_hash(first, tokens[4:8])]  # the partial block is not cached
    mirror = PrefixMirror()
    mirror.apply(BlockCached(request_id="r", parent_hash=0, block_ids=[0], block_hashes=[first]))
    assert mirror.match(prompt_block_hashes(tokens, 4)) == 1


# --------------------------------------------------------------------------- the controller
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


def test_pull_with_sticky_sessions_waits_for_a_slot_on_the_sessions_replica() -> None:
    router = Router("pull", 2, capacity=1)
    assert router.route(request("a", key="alice")).replica == 0  # type: ignore[union-attr]
    assert router.route(request("b")).replica == 1  # type: ignore[union-attr]
    assert router.route(request("c", key="alice")) is None  # replica 0 is full
    assert router.route(request("d")) is None
    # replica 1 frees a slot: "c" waits for alice's replica, so the next waiting request takes it
    assert [(r.request_id, d.replica) for r, d in router.release(1)] == [("d", 1)]
    assert [(r.request_id, d.replica) for r, d in router.release(0)] == [("c", 0)]
    assert not router.held


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


# --------------------------------------------------------------------------- metrics, health, taps
def batch(actor: str, *events: object, seq: int = 0) -> EventBatch:
    return EventBatch(actor=actor, first_seq=seq, mono=1.0, wall=1.0, events=list(events))  # type: ignore[arg-type]


def test_the_store_summarises_each_replica_and_the_sum() -> None:
    store = MetricsStore()
    store.record(batch("frontend-1", Arrived(request_id="a", num_prompt_tokens=3, max_tokens=4)), "frontend-1")
    store.record(batch("scheduler@0", Queued(request_id="a", num_waiting=1),
                       Finished(request_id="a", reason="length", num_prompt_tokens=3, num_output_tokens=4)),
                 "scheduler@0")
    store.record(batch("scheduler@1", Queued(request_id="b", num_waiting=1)), "scheduler@1")
    store.record(batch("frontend-2", Queued(request_id="c", num_waiting=1)), "frontend-2")  # a client may not
    store.record(batch("scheduler@1", Queued(request_id="d", num_waiting=1), seq=5), "scheduler@0")  # forged topic
    total, zero, one = store.summary(), store.summary(0), store.summary(1)
    assert total.replicas == [0, 1] and (zero.replica, one.replica) == (0, 1)
    assert (total.requests_finished, total.waiting) == (1, 1)
    assert (zero.requests_finished, zero.waiting, one.requests_finished, one.waiting) == (1, 0, 0, 1)
    assert store.summary(7).requests_finished == 0
    single = MetricsStore()
    single.record(batch("scheduler", Queued(request_id="a", num_waiting=1)), "scheduler")
    assert single.summary().replicas == [] and single.summary(0).waiting == 1  # one replica: the group


def test_health_stays_up_while_one_replica_is_whole() -> None:
    ready = {"controller": "ready", "scheduler@0": "ready", "worker-0@0": "ready", "kv_cache_manager@0": "ready",
             "scheduler@1": "ready", "worker-0@1": "restarting", "kv_cache_manager@1": "ready"}
    verdict = classify(ready)
    assert verdict.status == "degraded" and verdict.degraded == {"worker-0@1": "restarting"}
    both = classify({**ready, "scheduler@0": "restarting"})
    assert both.status == "unavailable" and set(both.unhealthy) == {"scheduler@0", "worker-0@1"}
    assert classify({**ready, "worker-0@1": "ready", "controller": "restarting"}).status == "unavailable"
    assert classify({"scheduler": "ready", "worker-0": "restarting"}).status == "unavailable"


def test_a_tap_filters_by_replica() -> None:
    only_one = TapFilter(replicas={1})
    routed = Routed(request_id="a", replica=1, reason="round_robin")
    assert only_one.matches("scheduler@1", Queued(request_id="a", num_waiting=0))
    assert not only_one.matches("scheduler@0", Queued(request_id="a", num_waiting=0))
    assert only_one.matches("controller", routed)
    assert not only_one.matches("controller", Routed(request_id="a", replica=0, reason="x"))
    assert TapFilter(replicas={0}).matches("scheduler", Queued(request_id="a", num_waiting=0))


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
