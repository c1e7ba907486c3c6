"""Replicas placed by Ray on a local two-node cluster (runtime/ray_replicas.py): each replica's
process group on its own node, over TCP with keys handed out by the launcher; a keyed client
generates through each, greedy-identical to an in-process engine; a peer without the keys is refused by
every TCP socket; a replica whose host dies shows as down. Through ``LLM(...,
distributed_executor_backend="ray")`` (runtime/ray_launch.py): the controller routes over the two
Ray-placed replicas, greedy-identical to DP=1; a replica's host killed mid-run loses no request (its
requests re-routed), and once Ray restarted it the set routes to it again."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_actors import LLM
from vllm_actors.clients.sync_client import EngineClient
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import Routed
from vllm_actors.protocol.metrics import EventsQuery, EventsReply
from vllm_actors.protocol.sampling import SamplingParams
from vllm_actors.runtime.run_dir import GroupInfo, read_group_info
from vllm_actors.runtime.security import KEYS_FILE

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from vllm_actors.runtime.ray_replicas import RayReplicaSet  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [9, 3, 2, 8], [11, 4]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _generate(info: GroupInfo, prompt: list[int], request_id: str) -> list[int]:
    client = EngineClient(info)
    try:
        client.submit(client.prepare(request_id, {"prompt_token_ids": prompt},
                                     SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)))
        while True:  # the client's own poll; a hang is the suite's per-test timeout's business
            finished = [output for output in client.poll(100) if output.finished]
            if finished:
                return list(finished[0].outputs[0].token_ids)
    finally:
        client.close()


def _refused(address: str, kind: int) -> bool:
    """A peer with a key pair of its own (not the replica's client key) connects: the handshake
    fails (ZMQ's monitor says so) and never succeeds."""
    context = zmq.Context()
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    public, secret = zmq.curve_keypair()
    socket.setsockopt(zmq.CURVE_SERVERKEY, public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, secret)
    events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL \
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    monitor = socket.get_monitor_socket(events)
    try:
        socket.connect(address)
        assert monitor.poll(60_000), f"no handshake outcome at {address}"
        return bool(recv_monitor_message(monitor)["event"] != zmq.EVENT_HANDSHAKE_SUCCEEDED)
    finally:
        socket.disable_monitor()
        monitor.close()
        socket.close()
        context.destroy(linger=0)


def test_two_replicas_on_two_nodes_serve_over_curve(cluster: Cluster, tiny_qwen3: Path,
                                                    greedy: dict[str, list[list[int]]]) -> None:
    config = EngineConfig(model=str(tiny_qwen3), num_gpu_blocks_override=32, device="cpu")
    expected = greedy["short"]
    with RayReplicaSet(config, 2, strategy="STRICT_SPREAD") as replicas:
        assert len({replicas.node_of(replica) for replica in replicas.replicas}) == 2
        assert replicas.states() == {0: "ready", 1: "ready"}
        for replica in replicas.replicas:
            info = read_group_info(replica.attach_dir)  # what any client here reads
            assert info.addresses.scheduler.startswith("tcp://")
            assert (replica.attach_dir / KEYS_FILE).stat().st_mode & 0o077 == 0
            got = [_generate(info, prompt, f"r{replica.index}-{i}") for i, prompt in enumerate(PROMPTS)]
            assert got == expected
            addresses = info.addresses
            for address, kind in [(addresses.scheduler, zmq.DEALER), (addresses.kv_cache_manager, zmq.DEALER),
                                  (addresses.metrics, zmq.DEALER), (addresses.bus_in, zmq.PUB),
                                  (addresses.bus_out, zmq.SUB), *((w, zmq.DEALER) for w in addresses.workers)]:
                assert _refused(address, kind), address
        # the two replicas' keys differ: one replica's client key opens nothing of the other
        assert replicas.replicas[0].keys.client_public != replicas.replicas[1].keys.client_public
        # a host that dies (its process killed, as when its node goes) shows as down
        victim = replicas.replicas[1]
        ray.kill(victim.actor, no_restart=True)
        deadline = time.monotonic() + 120
        while replicas.states()[1] != "down":
            assert time.monotonic() < deadline, "the killed replica never showed as down"
        assert replicas.states()[0] == "ready"


# --------------------------------------------------------------------------- LLM over Ray
SET_PROMPTS = [{"prompt_token_ids": [7 + i, 40 + 3 * i, 90 + i, 200 + 5 * i, 11]} for i in range(6)]
LONG = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy(tiny_qwen3: Path) -> dict[str, list[list[int]]]:
    """The greedy tokens of one engine in this process (the model is float32, as the replicas run it)."""
    with LLM(str(tiny_qwen3), executor="inprocess", dtype="float32") as llm:
        short = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                             SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        long = llm.generate(SET_PROMPTS, LONG, use_tqdm=False)
    return {"short": [list(o.outputs[0].token_ids) for o in short], "set": [list(o.outputs[0].token_ids) for o in long]}


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 180.0) -> None:
    """Wait for a condition (the timeout is a safety net, not part of the test)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s"
        time.sleep(0.05)


def test_llm_with_ray_backend_routes_over_two_nodes_and_survives_a_host_death(
        cluster: Cluster, tiny_qwen3: Path, greedy: dict[str, list[list[int]]]) -> None:
    reference = greedy["set"]
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        LLM(str(tiny_qwen3), distributed_executor_backend="slurm")
    with LLM(str(tiny_qwen3), dtype="float32", device="cpu", num_gpu_blocks_override=64, data_parallel_size=2,
             distributed_executor_backend="ray") as llm:
        group = llm.group
        assert group is not None and group.ray_launcher is not None
        replicas = group.ray_launcher.replica_set
        assert len({replicas.node_of(replica) for replica in replicas.replicas}) == 2  # one per node
        assert group.state()["scheduler@1"] == "ready"
        # both replicas serve, greedy-identical to DP=1; their events reach the set's store
        assert [list(o.outputs[0].token_ids) for o in llm.generate(SET_PROMPTS, LONG, use_tqdm=False)] == reference
        wait_until(lambda: all(llm.get_metrics(r).generation_tokens > 0 for r in (0, 1)), "both replicas' events")

        # replica 1's host killed while it generates: Ray restarts it, its requests move to replica 0
        victim = replicas.replicas[1]
        start_tokens = llm.get_metrics(1).generation_tokens
        killed, seen_down = threading.Event(), threading.Event()

        def kill_when_generating() -> None:
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and not killed.is_set():
                if llm.get_metrics(1).generation_tokens > start_tokens + 8:
                    ray.kill(victim.actor, no_restart=False)
                    killed.set()
                    wait_until(lambda: group.state()["scheduler@1"] != "ready", "replica 1 reported down")
                    seen_down.set()
                    return
                time.sleep(0.02)

        killer = threading.Thread(target=kill_when_generating, daemon=True)
        killer.start()
        outputs = llm.generate(SET_PROMPTS, LONG, use_tqdm=False)
        killer.join(timeout=200)
        assert killed.is_set(), "the host was not killed during the run"
        assert seen_down.is_set(), "the dead host's replica was never reported down"
        assert [list(o.outputs[0].token_ids) for o in outputs] == reference
        assert all(output.outputs[0].finish_reason == "length" for output in outputs)
        events = llm.engine.query_metrics(EventsQuery(since_index=0, limit=10_000))
        assert isinstance(events, EventsReply)
        rerouted = [e.event for e in events.events if isinstance(e.event, Routed) and e.event.reason == "rerouted"]
        assert rerouted and all(event.replica == 0 for event in rerouted)
        # Ray restarted the host: the controller takes its new endpoints and routes to it again
        wait_until(lambda: group.state()["scheduler@1"] == "ready", "replica 1 back")
        before = llm.get_metrics(1).requests_finished
        assert [list(o.outputs[0].token_ids) for o in llm.generate(SET_PROMPTS, LONG, use_tqdm=False)] == reference
        wait_until(lambda: llm.get_metrics(1).requests_finished > before, "the restarted replica served")
    assert group.stopped
