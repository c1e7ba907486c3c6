"""Replica sets, in process: replica names (on the bus, in the addresses, in each worker's devices),
the config's checks of the replica arguments, and per-replica views in the metrics store, the health
verdict and taps."""

from __future__ import annotations

import pytest

from vllm_actors.actors.metrics_store.store import MetricsStore
from vllm_actors.clients.supervision import classify
from vllm_actors.observe.tap_format import TapFilter
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import Arrived, EventBatch, Finished, Queued, Routed
from vllm_actors.protocol.names import is_engine_actor, replica_actor, replica_of, split_replica
from vllm_actors.runtime.bus import topic_allowed
from vllm_actors.runtime.process import ActorSpec
from vllm_actors.runtime.run_dir import make_addresses
from vllm_actors.runtime.supervisor import replica_environment


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


