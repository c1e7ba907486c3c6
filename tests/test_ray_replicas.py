"""Replicas placed by Ray on a local two-node cluster (runtime/ray_replicas.py): each replica's
process group on its own node, over TCP with keys handed out by the launcher; a keyed client
generates through each, greedy-identical to a local group; a peer without the keys is refused by
every TCP socket; a replica whose host dies shows as down."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from vllm_actors.clients.sync_client import EngineClient
from vllm_actors.protocol.config import EngineConfig
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


def test_two_replicas_on_two_nodes_serve_over_curve(cluster: Cluster, tiny_qwen3: Path) -> None:
    config = EngineConfig(model=str(tiny_qwen3), num_gpu_blocks_override=32, device="cpu")
    from vllm_actors.runtime.supervisor import ProcessGroup

    with ProcessGroup(config) as local:
        expected = [_generate(local.info, prompt, f"local-{i}") for i, prompt in enumerate(PROMPTS)]
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
